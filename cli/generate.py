"""``dflash2-mlx generate``.  MLX and the package are imported inside the functions that
use them, so that ``dflash2-mlx --help`` stays fast."""

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer


def register(app: typer.Typer):
    app.command("generate")(generate)


def read_messages(path: Path) -> list:
    """The chat messages of a --messages-file; a ValueError names the file and the problem."""
    try:
        messages = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--messages-file {path}: no such file")
    except IsADirectoryError:
        raise ValueError(f"--messages-file {path}: is a directory, not a JSON file")
    except OSError as e:
        raise ValueError(f"--messages-file {path}: cannot read it ({e.strerror})")
    except UnicodeDecodeError:
        raise ValueError(f"--messages-file {path}: not UTF-8 text")
    except json.JSONDecodeError as e:
        raise ValueError(f"--messages-file {path}: invalid JSON ({e.msg}, line {e.lineno} column {e.colno})")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"--messages-file {path}: must hold a JSON list of {{role, content}} objects")
    return messages


def template_config(text: Optional[str], option: str = "--chat-template-config") -> dict:
    """The JSON object of chat-template variables given to ``option``; a ValueError says
    what is wrong with it."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{option}: invalid JSON ({e.msg}, column {e.colno})")
    if not isinstance(config, dict):
        raise ValueError(f"{option}: must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return config


def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text ('-' reads stdin)."),
    messages_file: Optional[Path] = typer.Option(None, "--messages-file", help="JSON file with a list of chat messages [{role, content}]; rendered with the chat template."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: mlx-lm model directory or hub id. Default: the built-in SmolLM2-135M-Instruct."),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model", "-d", help="DFlash / DFlash 2 drafter directory or hub id. Default: the shipped drafter when --model is not given."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Most tokens to generate (-1: no limit, stop at end of sequence, as in mlx_lm.generate)."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Keep only the k most likely tokens (0 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Min-p filter (0 = off)."),
    min_tokens_to_keep: int = typer.Option(1, "--min-tokens-to-keep", min=1, help="Tokens the min-p filter always keeps."),
    xtc_probability: float = typer.Option(0.0, "--xtc-probability", help="XTC: the chance, per token, that the likeliest tokens are excluded (0 = off)."),
    xtc_threshold: float = typer.Option(0.1, "--xtc-threshold", help="XTC: tokens above this probability but the least likely of them are excluded ([0, 0.5])."),
    block_size: str = typer.Option("auto", "--block-size", help="Block size (anchor + drafted tokens): 'auto' chooses it every cycle from measured costs and live acceptance (1 = plain decoding); a number in 1..the drafter's trained size fixes it."),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", min=1, help="mlx_lm.generate's name for the tokens drafted a cycle: the same as --block-size N+1."),
    draft_window: Optional[int] = typer.Option(None, "--draft-window", help="Context rows a draft reads, the latest ones (default: all)."),
    draft_sink: int = typer.Option(0, "--draft-sink", min=0, help="With --draft-window: the first context rows a draft reads as well (attention sinks)."),
    draft_bits: Optional[int] = typer.Option(None, "--draft-bits", help="Quantize the drafter's weights to 2, 4 or 8 bits."),
    draft_group_size: int = typer.Option(64, "--draft-group-size", help="Group size for --draft-bits (32, 64 or 128)."),
    draft_activation_bits: int = typer.Option(32, "--draft-activation-bits", help="Drafter activation precision: 32 (fp32) or 16 (bf16)."),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help="Quantize the target's KV cache to this many bits, as mlx_lm.generate does (default: no quantization)."),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help="Group size for --kv-bits."),
    quantized_kv_start: int = typer.Option(5000, "--quantized-kv-start", help="With --kv-bits: quantize once the cache holds this many tokens (0: from the start), as mlx_lm.generate does."),
    adapter_path: Optional[str] = typer.Option(None, "--adapter-path", help="The target's LoRA adapters (a directory written by mlx_lm.lora), as in mlx_lm.generate."),
    copies: bool = typer.Option(True, "--copies/--no-copies", help="Where the text repeats itself (names, numbers, code, loops), verify a copy of what followed the repeated tokens before instead of a draft (no drafter pass); --no-copies drafts every block."),
    verify_mode: str = typer.Option("dflash", "--verify-mode", help="'dflash' (speculative), 'adaptive' (block size 'auto', a --block-size number is the largest), 'tree' (verify trees of drafted paths, see --tree-budget; 'ddtree' is the same) or 'off' (plain decoding)."),
    tree_budget: Optional[str] = typer.Option(None, "--tree-budget", help="With --verify-mode tree: drafted nodes per tree (1..64), or 'auto' (the default: the largest tree this machine verifies for about the chain's cost)."),
    cost_file: Optional[str] = typer.Option(None, "--cost-file", help="Choose 'auto' block sizes and tree budgets by the pass costs in this file (written by `dflash2-mlx doctor --export-costs`, e.g. on another machine) instead of this machine's calibration."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template", help="Feed --prompt as raw text instead of a user message in the chat template."),
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="A system message before the --prompt user turn (chat template)."),
    prefill_response: Optional[str] = typer.Option(None, "--prefill-response", help="The start of the assistant's reply, which the model continues (chat template)."),
    chat_template_config: Optional[str] = typer.Option(None, "--chat-template-config", help="Extra chat-template arguments as a JSON object, e.g. '{\"enable_thinking\": false}'."),
    extra_eos_token: List[str] = typer.Option([], "--extra-eos-token", help="Another token (its text or id) that ends the reply; repeatable."),
    prefill_step_size: int = typer.Option(2048, "--prefill-step-size", help="Prompt tokens per prefill pass."),
    max_kv_size: Optional[int] = typer.Option(None, "--max-kv-size", min=1, help="Bound the target's KV cache to this many tokens (a rotating cache), as mlx_lm.generate does; plain decoding only (--verify-mode off)."),
    prompt_cache_file: Optional[Path] = typer.Option(None, "--prompt-cache-file", help="A prompt cache saved by mlx_lm.cache_prompt: the prompt continues after its tokens, as in mlx_lm.generate (the model defaults to the one that made it)."),
    exact: bool = typer.Option(False, "--exact", help="Compute every verify row as the target's own one-row decode step does, so greedy output is plain decoding's bit for bit on this machine (free where its verify passes are already row-exact: the probe, run once; else one verify pass whose rows run as one-row steps run, where the probe found that exact, or one-row steps)."),
    verbose: bool = typer.Option(True, "--verbose/--quiet", help="Print the stats line after the text."),
    distributed: Optional[str] = typer.Option(None, "--distributed", help="Split the target over the mx.distributed ranks this runs as (under mlx.launch): 'tensor' (mlx-lm's shard: heads and MLP split over the ranks) or 'pipeline' (layer ranges). Rank 0 prints; every rank needs the same model files."),
):
    """Generate text with DFlash speculative decoding, streaming it, then a stats line."""
    from dflash2_mlx import stream_generate
    from dflash2_mlx.responses import stats_line
    from ..request.arguments import check_all, check_messages
    from ..request.sampling import xtc_special_tokens

    if (prompt is None) == (messages_file is None):
        raise typer.BadParameter("give exactly one of --prompt or --messages-file")
    prompt = typed_prompt(prompt)
    last, shown = None, True  # shown: this rank prints the text (rank 0 of a split target)
    try:
        if distributed is not None and prompt_cache_file is not None:
            raise ValueError("--prompt-cache-file goes without --distributed: a saved cache holds the whole target's "
                             "keys and values, a split target's rank only its share")
        if distributed == "pipeline" and exact:
            raise ValueError("--exact goes without --distributed pipeline: the exactness probe and the row-exact "
                             "pass read the whole model on one machine")
        # Every argument is checked before a model is loaded: a bad one costs nothing.
        check_all(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
                  xtc_probability=xtc_probability, xtc_threshold=xtc_threshold, seed=seed, max_tokens=max_tokens)
        block_size = block_size_of(block_size, num_draft_tokens)
        template_kwargs = template_config(chat_template_config)
        if messages_file is not None:
            prompt = read_messages(messages_file)
            check_messages(prompt, f"--messages-file {messages_file}")
            if system_prompt is not None:
                raise ValueError("--system-prompt goes with --prompt; put a system message in --messages-file")
        target, tokenizer, drafter, cache = load_pair(
            model, draft, prompt_cache_file, kv_bits, kv_group_size, extra_eos_token, max_kv_size,
            verify_mode, draft_bits=draft_bits, draft_group_size=draft_group_size,
            draft_activation_bits=draft_activation_bits, adapter_path=adapter_path, distributed=distributed)
        shown = distributed is None or rank_of(target) == 0
        prompt = prompt_ids(tokenizer, prompt, system_prompt, prefill_response, template_kwargs,
                            ignore_chat_template, after_cache=prompt_cache_file is not None)
        for last in stream_generate(
                target, tokenizer, prompt, drafter, max_tokens=max_tokens, temp=temp,
                top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
                xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                xtc_special_tokens=xtc_special_tokens(tokenizer), block_size=block_size,
                verify_mode=verify_mode, seed=seed, draft_window=draft_window, draft_sink=draft_sink, lookup=copies,
                prefill_step_size=prefill_step_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
                quantized_kv_start=quantized_kv_start, prompt_cache=cache, exact=exact, tree_budget=tree_budget,
                cost_file=cost_file):
            if shown:
                typer.echo(last.text, nl=False)
    except (ValueError, TypeError) as e:
        typer.echo(("\n" if last is not None and shown else "") + f"error: {e}", err=True)
        raise typer.Exit(2)
    except RuntimeError as e:
        if distributed is None:
            raise
        from ..distributed import failure_message

        typer.echo(("\n" if last is not None and shown else "") + f"error: {failure_message(e)}", err=True)
        raise typer.Exit(1)
    if not shown:
        return
    typer.echo()
    sys.stdout.flush()
    if verbose and last is not None:
        typer.echo(stats_line(last), err=True)


def rank_of(target) -> int:
    """This process's rank in the group ``target`` is split over (0 for a whole one)."""
    from ..distributed import group_of

    group = group_of(target)
    return group.rank() if group is not None else 0


def typed_prompt(prompt: Optional[str]) -> Optional[str]:
    """--prompt as mlx_lm.generate reads it: '-' reads stdin, a typed \\n or \\t is the character."""
    if prompt == "-":
        return sys.stdin.read()
    return prompt.replace("\\n", "\n").replace("\\t", "\t") if prompt is not None else None


def block_size_of(block_size: str, num_draft_tokens: Optional[int]) -> str:
    """--block-size, or mlx_lm.generate's --num-draft-tokens N: a block of N + 1."""
    if num_draft_tokens is None:
        return block_size
    if block_size != "auto":
        raise ValueError("give --block-size or --num-draft-tokens, not both")
    return str(num_draft_tokens + 1)


def load_pair(model: Optional[str], draft: Optional[str], prompt_cache_file: Optional[Path],
              kv_bits: Optional[int], kv_group_size: int, extra_eos_token: List[str],
              max_kv_size: Optional[int], verify_mode: str, **load_options):
    """(target, tokenizer with the --extra-eos-token tokens, drafter, cache): the cache of
    --prompt-cache-file, else --max-kv-size's, else None.  The model defaults to the one the
    cache file was made with; no --model and no cache file: the built-in pair (and the
    shipped drafter unless --draft is given)."""
    from dflash2_mlx import load
    from ..builtin.smollm2 import is_builtin_target
    from ..loop.prompt_cache_file import read_prompt_cache

    cache = tokenizer_config = None
    if prompt_cache_file is not None:
        cache, made_with, tokenizer_config = read_prompt_cache(prompt_cache_file, model, kv_bits, kv_group_size)
        if model is None and not is_builtin_target(made_with):
            model = made_with
    target, tokenizer, drafter = load(model, draft, tokenizer_config=tokenizer_config, **load_options)
    for token in extra_eos_token:
        tokenizer.add_eos_token(token)
    if max_kv_size is not None and cache is None:  # as in mlx_lm.generate: a cache file wins
        cache = rotating_cache(target, drafter is not None and verify_mode != "off", max_kv_size)
    return target, tokenizer, drafter, cache


def rotating_cache(target, speculative: bool, max_kv_size: int) -> list:
    """--max-kv-size's rotating cache, as mlx_lm.generate makes it (plain decoding only)."""
    from mlx_lm.models.cache import make_prompt_cache

    if speculative:
        raise ValueError("--max-kv-size goes with --verify-mode off: a verify pass over a "
                         "rotating cache would read more keys than one-token steps do, so "
                         "the text would not be the target's")
    return make_prompt_cache(target, max_kv_size)


def prompt_ids(tokenizer, prompt, system_prompt: Optional[str], prefill_response: Optional[str],
               template_kwargs: dict, ignore_chat_template: bool, after_cache: bool):
    """The prompt as stream_generate takes it.  As mlx_lm.generate does, a text prompt becomes
    a user turn of the chat template (unless --ignore-chat-template), and chat messages are
    rendered with it: after a prompt cache file, only what follows its cached prefix."""
    from dflash2_mlx.request.prompt import chat_ids
    from ..loop.prompt_cache_file import query_ids

    templated = not ignore_chat_template and getattr(tokenizer, "chat_template", None)
    if isinstance(prompt, str) and templated:
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        prompt = system + [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and after_cache:
        return query_ids(tokenizer, prompt, prefill_response, template_kwargs)
    if isinstance(prompt, list):
        return chat_ids(tokenizer, prompt, prefill_response, template_kwargs=template_kwargs)
    if system_prompt is not None or prefill_response is not None or template_kwargs:
        why = "--ignore-chat-template" if ignore_chat_template else "this tokenizer has no chat template"
        raise ValueError(f"--system-prompt, --prefill-response and --chat-template-config need the "
                         f"chat template ({why})")
    return prompt
