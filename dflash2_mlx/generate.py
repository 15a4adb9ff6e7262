"""The public surface in mlx-lm's shape: ``load``, ``stream_generate``, ``generate``."""

import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generate_step, wired_limit
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import adaptive, calibration, distributed as dist, kernels
from .calibration import exactness
from .distributed import agree, fingerprint
from .loop.cycle import dflash_steps
from .loop.draft_context import DraftContext, chat_context
from .loop import verifiers
from .loop.target import Target, attach
from .model.checkpoint import CheckpointError, load_drafter, quantize, resolve, set_activation_bits
from .model.drafter import Drafter, propose
from .request.modes import VERIFY_MODES
from .request.plan import Plan, Reuse
from .request.prompt import encode_prompt
from .request.sampling import SamplingParams
from .responses import GenerationResponse, responses, stats_line

__all__ = ["VERIFY_MODES", "GenerationResponse", "generate", "load", "speculative_generate_step", "stats_line",
           "stream_generate", "warm_kernels"]


def load(target: Optional[str] = None, draft: Optional[str] = None, *,
         draft_bits: Optional[int] = None, draft_group_size: int = 64,
         draft_activation_bits: int = 32, adapter_path: Optional[str] = None,
         tokenizer_config: Optional[dict] = None, distributed: Optional[str] = None, group=None):
    """Load a target with mlx-lm and, optionally, its drafter (validated against it).
    ``adapter_path``: the target's LoRA / DoRA / full fine-tune adapters, as mlx-lm's
    ``load`` applies them (drafts are still verified by the adapted target: lossless).
    ``tokenizer_config``: mlx-lm's (e.g. a prompt cache file's).

    Without ``target``: the built-in pair, SmolLM2-135M-Instruct (converted into the cache
    on first use, offline once it is there) and, unless ``draft`` is given, the DFlash 2
    drafter shipped for it.  Returns (model, tokenizer, drafter); drafter is None when a
    ``target`` is given without ``draft``.

    ``distributed``: split the target over ``mx.distributed`` ranks, "tensor" (mlx-lm's
    ``shard``) or "pipeline" (layer ranges), over ``group`` (default: ``mx.distributed.init()``,
    as ``mlx.launch`` sets it up).  Every rank checks that all hold the same files, loads the
    target lazily (only its share is read), splits it and loads the drafter whole;
    ``generate`` / ``stream_generate`` then run on every rank alike (docs/distributed.md)."""
    if target is None:
        # Imported here: the built-in pair's converter needs the GGUF packages, which loading
        # any other pair (and ``import dflash2_mlx``) does not.
        from .builtin.defaults import default_pair

        target, shipped = default_pair()
        draft = draft or shipped
    adapters = Path(adapter_path).expanduser() if adapter_path is not None else None
    if adapters is not None and not (adapters / "adapter_config.json").is_file():
        raise CheckpointError(f"no adapter_config.json in {adapter_path} (adapters: a directory written by mlx_lm.lora)")
    if distributed is not None:
        dist.check_mode(distributed)
        group = dist.init(group)
        fingerprint.check(group, resolve(target), resolve(draft) if draft is not None else None)
    target_dir = resolve(target)
    model, tokenizer = mlx_lm.load(str(target_dir), adapter_path=adapters and str(adapters),
                                   tokenizer_config=tokenizer_config or {}, lazy=distributed is not None)
    if distributed is None:
        exactness.loaded(model, exactness.source_of(target_dir, adapters))
    drafter = None
    if draft is not None:
        drafter = load_drafter(draft, target=model)  # checked against the whole target
        if draft_bits is not None:
            quantize(drafter, draft_bits, draft_group_size)
        set_activation_bits(drafter, draft_activation_bits)
    if distributed is not None:
        dist.split(model, group, distributed)
        mx.eval(model.parameters())
    if drafter is not None:
        warm_kernels(model, drafter)
    return model, tokenizer, drafter


def warm_kernels(model, drafter: Drafter, sizes: Optional[Sequence[int]] = None):
    """On Metal, build and self-check now every kernel variant a single stream launches
    (each block size 2..the trained size, greedy and sampled), so that no request waits for
    a compile and a check in the middle of a reply.  Elsewhere (the twins run) nothing."""
    if kernels.reference_forced() or not kernels.dispatch.metal_usable():
        return
    target = attach(model, drafter)
    feats = mx.zeros((1, 1, len(drafter.config.target_layer_ids) * target.hidden_size))
    for b in sizes or range(2, drafter.config.block_size + 1):
        context = DraftContext(drafter)
        context.add(feats)
        hidden = drafter(mx.array([[0] + [drafter.config.mask_token_id] * (b - 1)]), context.fed())
        for params in (SamplingParams(), SamplingParams(temp=1.0)):
            mx.eval(propose(drafter, hidden, mx.array(0), params))


def stream_generate(model, tokenizer, prompt, drafter: Optional[Drafter] = None, *,
                    max_tokens: int = 256, temp: float = 0.0, top_p: float = 1.0,
                    min_p: float = 0.0, top_k: int = 0, min_tokens_to_keep: int = 1,
                    xtc_probability: float = 0.0, xtc_threshold: float = 0.1,
                    xtc_special_tokens: Optional[Sequence[int]] = None,
                    logits_processors: Optional[List[Callable]] = None,
                    block_size: Union[int, str, None] = adaptive.AUTO, verify_mode: str = "dflash",
                    seed: Optional[int] = None, prefill_step_size: int = 2048,
                    draft_window: Optional[int] = None, draft_sink: int = 0,
                    prompt_cache: Optional[list] = None, draft_context=None, cached_tokens: int = 0,
                    lookup: bool = True, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START, continues: bool = False,
                    exact: bool = False, tree_budget: Union[int, str, None] = None,
                    cost_file: Optional[str] = None):
    """Yield a GenerationResponse per token, as mlx_lm.stream_generate does.

    With a drafter and ``verify_mode="dflash"`` tokens come from DFlash cycles with
    ``block_size`` ("auto": chosen every cycle, see ``adaptive``; a number fixes it);
    ``verify_mode="adaptive"`` is "auto" with a number as the largest block;
    ``verify_mode="tree"`` (or oMLX's "ddtree") verifies trees of ``tree_budget`` drafted
    nodes (a number, or "auto": sized by this machine's cost curve), as deep as the block,
    where the target can take one (``docs/tree.md``);
    ``verify_mode="off"`` (or no drafter) is plain autoregressive decoding.
    ``draft_window``: how many of the latest context rows a draft reads (None: all), besides
    the first ``draft_sink`` rows, which it always reads.
    ``lookup``: where the sequence repeats itself a block may be a copy of what followed
    the repeated tokens before (``loop/lookup.py``); False: every block is the drafter's.
    A reused prefix (the server's prefix cache): ``prompt_cache`` (and with DFlash
    ``draft_context``) already hold the first ``cached_tokens`` prompt tokens.
    A ``prompt_cache`` given without ``draft_context`` is used as mlx-lm uses it: the prompt
    goes in after what it holds, and it ends holding the prompt and every token yielded (no
    draft accepted but not yielded), so a chat continued from it is mlx-lm's own; the
    drafter's context of those tokens is kept beside it (``chat_context``).
    ``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start``: mlx-lm's KV cache quantization,
    applied where mlx-lm applies it.
    Sampling takes ``mlx_lm.sample_utils.make_sampler``'s arguments (XTC's special tokens:
    none unless given, as there; mlx-lm's CLI and server give "\n" and the EOS tokens).
    ``continues``: the reply continues the prompt's last text (a prefilled reply), so its
    first token keeps a leading space (``detokenizer_after``).
    ``exact``: every verify row is computed as the target's own one-row decode step computes
    it, so greedy output is plain decoding's bit for bit on any backend.  Where this machine's
    verify passes are already row-exact (the probe, ``loop/exactness.py``, run once and kept
    by ``calibration/exactness.py``)
    this costs nothing; where they are not, each verify row becomes a one-row step (slower).
    Each response's ``exactness`` says which guarantee holds.
    ``cost_file``: the pass costs that "auto" block sizes and tree budgets are chosen by, from
    a file ``dflash2-mlx doctor --export-costs`` wrote (another machine's, say) instead of
    this machine's calibration."""
    plan = Plan.of(drafter, **{k: v for k, v in locals().items() if k not in _NOT_PLANNED})
    yield from stream_plan(model, tokenizer, prompt, drafter, plan, Reuse(prompt_cache, draft_context, cached_tokens))


# stream_generate's arguments that are not the plan's: the pair, the prompt, a reused prefix.
_NOT_PLANNED = ("model", "tokenizer", "prompt", "drafter", "prompt_cache", "draft_context", "cached_tokens")


def stream_plan(model, tokenizer, prompt, drafter: Optional[Drafter], plan: Plan, reuse: Optional[Reuse] = None):
    """``stream_generate`` for a plan already made (a server's request makes its own, from
    its options and the model's settings: ``backend/options.py: decoding_plan``)."""
    reuse = reuse or Reuse()
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = encode_prompt(tokenizer, prompt)
    if plan.seed is not None:
        mx.random.seed(plan.seed)
    elif dist.group_of(model) is not None and not plan.params.greedy:
        mx.random.seed(agree.shared_seed(dist.group_of(model)))  # the ranks must sample alike
    policy, exact_note = None, "exact"  # plain decoding is the target's own
    if plan.verify != "off":
        # The verdict decides how exact rows are verified (with ``exact``: probed now if
        # this machine has none), and what the reply says of them.
        verifiers.check(model, plan.exact)
        exact_note, one_row = exactness.exactness_of(model, plan.exact)
        policy, tokens = _dflash_steps(model, drafter, ids, plan, reuse, one_row)
    else:
        tokens = _plain_steps(model, ids[reuse.cached_tokens:], plan, reuse.prompt_cache)
    # The prompt's time starts here: a first use's calibration (above) is not its.
    tic = time.perf_counter()
    try:
        # As mlx-lm's stream_generate: on Metal the weights stay wired while it decodes.
        with wired_limit(model):
            for r in responses(tokens, tokenizer, ids, plan.limit, tic, plan.continues):
                if r.finish_reason is not None and exactness.probe_if_owed(policy, model) and not plan.exact:
                    exact_note = exactness.exactness_of(model, False)[0]
                r.exactness = exact_note
                yield r
    finally:
        tokens.close()  # now, not when collected: a prompt_cache is settled before this returns
        calibration.remember(policy)


def _dflash_steps(model, drafter: Drafter, ids: mx.array, plan: Plan, reuse: Reuse, one_row: Optional[str]):
    """(the block-size policy, the DFlash cycles' (token, logprobs, from_draft, stats)).  A
    ``prompt_cache`` without a ``draft_context`` is mlx-lm's use of one: the drafter's context
    is the one kept beside it (``chat_context``), and the cache is settled when the steps end."""
    target = attach(model, drafter, exact=one_row)
    cache, context = reuse.prompt_cache, reuse.draft_context
    if cache is not None:
        target.check_cache(cache)
    chat = cache is not None and context is None
    if chat:
        context = chat_context(cache, drafter, plan.draft_window, plan.draft_sink)
    group = dist.group_of(model)
    if group is not None and plan.auto:
        calibration.prepare_split(target, drafter, group)  # calibrated by all ranks together, or none
    costs = calibration.load_costs(plan.cost_file, target, drafter) if plan.cost_file else None
    policy = agree.agreed(_block_policy(target, drafter, plan, one_row, costs), group)
    return policy, dflash_steps(ids, target, drafter, plan, policy, Reuse(cache, context, reuse.cached_tokens),
                                settle=chat, costs=_tree_costs(target, drafter, plan, policy, costs))


def _block_policy(target, drafter: Drafter, plan: Plan, one_row: Optional[str] = None, costs=None):
    """The block-size policy of one request (``calibration.policy``).  "auto" measures the
    machine's costs on a pair's first request (``calibration.calibrate``).  Sampling with a seed
    starts without the pair's history (same seed and costs, same text); greedy text is the
    target's whatever the block sizes, so it always uses it.  ``one_row``: verify rows are
    made exact (exact=True here: a row-exact pass or one-row steps), priced as one-row steps."""
    if one_row and plan.auto:
        costs = (costs or calibration.costs(target, drafter)).one_row_verify()
    greedy = plan.params.greedy
    return calibration.policy(target, drafter, plan.block_size, greedy=greedy, history=plan.seed is None or greedy,
                              costs=costs, largest=plan.largest)


def _tree_costs(target, drafter: Drafter, plan: Plan, policy, costs=None):
    """The costs a tree budget of "auto" is sized by (else None): ``costs`` (a cost file's)
    or the policy's calibrated curve, not its live timing's correction (that corrects a
    chain's or a copy's cycle; tree cycles are timed by ``trees.Arms`` itself), and the
    whole curve where a first use measured a chain's rows only."""
    if plan.tree_budget != "auto":
        return None
    costs = costs or getattr(policy, "costs", None) or calibration.costs(target, drafter)
    costs = costs.costs if isinstance(costs, adaptive.Corrected) else costs
    return calibration.costs(target, drafter, whole=True) if getattr(costs, "coarse", False) else costs


def speculative_generate_step(prompt: mx.array, target: Target, drafter: Drafter, *,
                              block_size: Union[int, str, adaptive.Policy] = adaptive.AUTO,
                              prompt_cache: Optional[list] = None, context: Optional[DraftContext] = None,
                              cached_tokens: int = 0, settle: bool = False,
                              costs: Optional[adaptive.CostModel] = None, **planned):
    """The DFlash steps (``loop.cycle.dflash_steps``) under mlx-lm generate_step's keyword
    arguments, priced by the calibration service.  ``block_size``: a number, "auto", or a
    policy (``adaptive.Policy``); a reused prefix: the first ``cached_tokens`` of the prompt
    are already in ``prompt_cache`` and ``context``; ``costs``: what a tree budget of "auto"
    is sized by; ``planned``: the ``Plan``'s fields (``max_tokens``, ``params``, ``lookup``,
    ``tree_budget``, ``draft_window``, mlx-lm's KV quantization, ...)."""
    given = block_size if isinstance(block_size, adaptive.Policy) else None
    plan = Plan(block_size=adaptive.AUTO if given is not None else block_size, **planned)
    policy = given or calibration.policy(target, drafter, plan.block_size, plan.params.greedy, largest=plan.largest)
    return dflash_steps(prompt, target, drafter, plan, policy, Reuse(prompt_cache, context, cached_tokens),
                        settle, _tree_costs(target, drafter, plan, policy, costs))


def _plain_steps(model, ids: mx.array, plan: Plan, prompt_cache: Optional[list]):
    """mlx-lm's own decoding (``generate_step``), as (token, logprobs, False, None)."""
    p = plan.params
    sampler = make_sampler(p.temp, p.top_p if p.top_p < 1.0 else 0.0, p.min_p, p.min_tokens_to_keep, top_k=p.top_k,
                           xtc_probability=p.xtc_probability, xtc_threshold=p.xtc_threshold,
                           xtc_special_tokens=list(p.xtc_special_tokens))
    return ((int(t), lp, False, None) for t, lp in generate_step(ids, model, max_tokens=plan.max_tokens,
                                                                  sampler=sampler, prompt_cache=prompt_cache,
                                                                  **plan.mlx_lm_args()))


def generate(model, tokenizer, prompt, drafter: Optional[Drafter] = None, verbose: bool = False,
             **kwargs) -> str:
    """Generate a complete response; with ``verbose`` print it as it streams plus stats."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, drafter, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(stats_line(last))
    return text


