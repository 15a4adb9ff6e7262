"""The public surface in mlx-lm's shape: ``load``, ``stream_generate``, ``generate``."""

import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generate_step, wired_limit
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import adaptive, distributed as dist, kernels
from .adaptive import check_block_size
from .distributed import agree, fingerprint
from .loop import exactness
from .loop.draft_context import DraftContext
from .model.drafter import Drafter, propose
from .model.checkpoint import CheckpointError, load_drafter, quantize, resolve, set_activation_bits
from .request.arguments import check_all
from .request.prompt import encode_prompt
from .request.sampling import SamplingParams
from .loop.cycle import speculative_generate_step
from .loop.kv_quant import kv_offset
from .loop.target import attach
from . import tree as trees

VERIFY_MODES = ("dflash", "adaptive", "tree", "ddtree", "off")  # ddtree: oMLX's name for tree


@dataclass
class GenerationResponse:
    """mlx-lm's response fields plus the draft statistics of the generation so far."""
    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    accepted: int = 0  # draft tokens accepted in the cycle that produced this token
    tau: float = 0.0  # running mean acceptance length
    acceptance_counts: List[int] = field(default_factory=list)  # per draft position
    cycles: int = 0
    block_sizes: Dict[int, int] = field(default_factory=dict)  # cycles per block size so far
    fallback: bool = False  # adaptive mode is decoding plain for now (probing the drafter)
    shadows: int = 0  # plain steps so far that also drafted, unverified, to follow the drafter
    copies: int = 0  # cycles so far that verified a copy of earlier tokens (no drafter pass)
    copied: int = 0  # ... and the copied tokens they accepted
    exactness: str = ""  # whether greedy output is the target's own bit for bit here (exactness.py)
    trees: int = 0  # cycles so far that verified a tree (verify_mode="tree")
    tree_nodes: int = 0  # ... the drafted nodes they verified
    tree_accepted: int = 0  # ... and the depth they accepted
    chain_why: Optional[str] = None  # tree mode: why the latest drafted cycle verified a chain


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
    verify passes are already row-exact (the probe, ``loop/exactness.py``, run once and kept)
    this costs nothing; where they are not, each verify row becomes a one-row step (slower).
    Each response's ``exactness`` says which guarantee holds.
    ``cost_file``: the pass costs that "auto" block sizes and tree budgets are chosen by, from
    a file ``dflash2-mlx doctor --export-costs`` wrote (another machine's, say) instead of
    this machine's calibration."""
    check_all(max_tokens=max_tokens, seed=seed, exact=exact, lookup=lookup, continues=continues)
    if verify_mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {verify_mode!r} is not supported; use one of {VERIFY_MODES}")
    if tree_budget is not None and verify_mode not in ("tree", "ddtree"):
        raise ValueError(f"tree_budget={tree_budget!r} needs verify_mode='tree' (got {verify_mode!r})")
    if verify_mode in ("tree", "ddtree"):
        tree_budget = trees.check_budget(tree_budget)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    params = SamplingParams(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k,
                            min_tokens_to_keep=min_tokens_to_keep, xtc_probability=xtc_probability,
                            xtc_threshold=xtc_threshold, xtc_special_tokens=tuple(xtc_special_tokens or ()))
    ids = encode_prompt(tokenizer, prompt)
    limit = max_tokens if max_tokens > 0 else float("inf")
    if seed is not None:
        mx.random.seed(seed)
    elif dist.group_of(model) is not None and not params.greedy:
        mx.random.seed(agree.shared_seed(dist.group_of(model)))  # the ranks must sample alike
    # What both kinds of decoding take, under the same names as mlx-lm's generate_step.
    shared = dict(logits_processors=logits_processors, prompt_cache=prompt_cache,
                  prefill_step_size=prefill_step_size, kv_bits=kv_bits, kv_group_size=kv_group_size,
                  quantized_kv_start=quantized_kv_start)
    policy, exact_note = None, "exact"  # plain decoding is the target's own
    if drafter is not None and verify_mode != "off":
        # Exact rows decide how to verify before the steps; otherwise the reply's note is read
        # after them (a first use's calibration keeps a verdict beside it).
        exact_note, one_row = exactness_of(model, True) if exact else (None, None)
        policy, tokens = _dflash_steps(model, drafter, ids, params, limit, block_size, verify_mode, seed,
                                      draft_window, draft_sink, draft_context, cached_tokens, lookup,
                                      one_row=one_row, tree_budget=tree_budget, cost_file=cost_file, **shared)
        if not exact:
            exact_note = exactness_of(model, False)[0]
    else:
        tokens = _plain_steps(model, ids[cached_tokens:], max_tokens, params, **shared)
    # The prompt's time starts here: a first use's calibration (above) is not its.
    tic = time.perf_counter()
    owed = _probe_owed(policy)
    try:
        # As mlx-lm's stream_generate: on Metal the weights stay wired while it decodes.
        with wired_limit(model):
            for r in _responses(tokens, tokenizer, ids, limit, tic, continues):
                if r.finish_reason is not None and owed is not None:
                    owed.first_use, owed = False, None
                    exactness.at_first_use(model)
                    exact_note = exact_note if exact else exactness_of(model, False)[0]
                r.exactness = exact_note
                yield r
    finally:
        tokens.close()  # now, not when collected: a prompt_cache is settled before this returns
        adaptive.remember(policy)


def _dflash_steps(model, drafter: Drafter, ids: mx.array, params: SamplingParams, limit, block_size,
                 verify_mode: str, seed: Optional[int], draft_window: Optional[int], draft_sink: int,
                 draft_context, cached_tokens: int, lookup: bool, prompt_cache: Optional[list] = None,
                 one_row: Optional[str] = None, tree_budget=None, cost_file: Optional[str] = None, **shared):
    """(the block-size policy, the DFlash cycles' (token, logprobs, from_draft, stats)).  A
    ``prompt_cache`` without a ``draft_context`` is mlx-lm's use of one: the drafter's context
    is the one kept beside it (``chat_context``), and the cache is settled when the steps end."""
    block_size = check_block_size(drafter, block_size)
    target = attach(model, drafter)
    target.exact = one_row
    if prompt_cache is not None:
        target.check_cache(prompt_cache)
    chat = prompt_cache is not None and draft_context is None
    if chat:
        draft_context = chat_context(prompt_cache, drafter, draft_window, draft_sink)
    group = dist.group_of(model)
    if group is not None and (block_size == adaptive.AUTO or verify_mode == "adaptive"):
        agree.prepare_costs(target, drafter, group)  # calibrated by all ranks together, or none
    costs = adaptive.load_costs(cost_file, target, drafter) if cost_file else None
    policy = agree.agreed(_block_policy(target, drafter, block_size, verify_mode, params.greedy, seed,
                                        one_row, costs), group)
    return policy, speculative_generate_step(
        ids, target, drafter, max_tokens=limit, params=params, block_size=policy,
        draft_window=draft_window, draft_sink=draft_sink, prompt_cache=prompt_cache,
        context=draft_context, cached_tokens=cached_tokens, lookup=lookup, settle=chat,
        tree_budget=tree_budget, costs=costs, **shared)


def _probe_owed(policy):
    """The cost model ``policy`` prices with when this process measured it at the pair's first
    use (its reply ends with the exactness probe), else None."""
    costs = getattr(policy, "costs", None)
    costs = getattr(costs, "costs", costs)  # under the live timing's correction
    return costs if getattr(costs, "first_use", False) else None


def exactness_of(model, exact: bool) -> Tuple[str, Optional[str]]:
    """(what a response says of its exactness, how verify rows are made exact: None where
    passes are row-exact already or exactness was not asked, "pass" for a row-exact pass,
    "steps" for one-row steps).  With ``exact`` the probe runs now if this machine has no
    verdict for the target yet."""
    verdict = exactness.verdict(model) if exact else exactness.known(model)  # probes the pass if untried
    if verdict is None:
        return f"{exactness.NOT_PROBED} (dflash2-mlx doctor --exact)", None
    if verdict.exact:
        return "exact", None
    if exact and verdict.exact_pass:
        return f"exact, by the exact mode's row-exact verify pass (ordinary passes here are {verdict.describe()})", "pass"
    if exact:
        return f"exact, by the exact mode's one-row verify (ordinary passes here are {verdict.describe()})", "steps"
    return (f"{verdict.describe()}: greedy output may leave plain decoding's where two tokens nearly tie "
            "(the exact mode rules that out: --exact, exact=True, dflash_exact)"), None


def _block_policy(target, drafter: Drafter, block_size, verify_mode: str, greedy: bool, seed: Optional[int],
                  one_row: Optional[str] = None, costs=None):
    """The block-size policy of one request (``adaptive.policy``).  "auto" measures the
    machine's costs on a pair's first request (``adaptive.calibrate``).  Sampling with a seed
    starts without the pair's history (same seed and costs, same text); greedy text is the
    target's whatever the block sizes, so it always uses it.  ``one_row``: verify rows are
    made exact (exact=True here: a row-exact pass or one-row steps), priced as one-row steps."""
    auto = block_size == adaptive.AUTO or verify_mode == "adaptive"
    if one_row and auto:
        costs = (costs or adaptive.cost_model(target, drafter)).one_row_verify()
    return adaptive.policy(target, drafter, adaptive.AUTO if verify_mode == "adaptive" else block_size,
                           greedy=greedy, history=seed is None or greedy, costs=costs,
                           largest=None if block_size == adaptive.AUTO else block_size)


def _plain_steps(model, ids: mx.array, max_tokens: int, params: SamplingParams, **shared):
    """mlx-lm's own decoding (``generate_step``), as (token, logprobs, False, None)."""
    sampler = make_sampler(params.temp, params.top_p if params.top_p < 1.0 else 0.0, params.min_p,
                           params.min_tokens_to_keep, top_k=params.top_k,
                           xtc_probability=params.xtc_probability, xtc_threshold=params.xtc_threshold,
                           xtc_special_tokens=list(params.xtc_special_tokens))
    return ((int(t), lp, False, None) for t, lp in generate_step(ids, model, max_tokens=max_tokens,
                                                                  sampler=sampler, **shared))


# A prompt cache's first layer -> the drafter context of the tokens it holds, for mlx-lm's
# use of a prompt cache (the caller keeps only the target's cache from turn to turn).
chat_contexts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def chat_context(prompt_cache: list, drafter: Drafter, window: Optional[int], sink: int) -> DraftContext:
    """The drafter context of the tokens ``prompt_cache`` holds, kept from the call that left
    them there; a fresh one (this call's tokens only) where none matches the cache."""
    context = chat_contexts.get(prompt_cache[0])
    if (context is None or context.drafter is not drafter or (context.window, context.sink) != (window, sink)
            or context.size != kv_offset(prompt_cache)):
        context = DraftContext(drafter, window, sink)
    chat_contexts[prompt_cache[0]] = context
    return context


def detokenizer_after(tokenizer, ids: Sequence[int] = ()):
    """A streaming detokenizer whose text goes on after token ids ``ids`` (none: a text of
    its own).  mlx-lm's drop the leading space of a text's first token, right for a reply
    that starts a message and wrong for one that continues a prefill ("The sky is" + " blue"):
    fed the prompt's last token first, the reply's first token is not a text's first.  A
    last token that leaves bytes pending (a lone space, part of a character) is not fed."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    if len(ids):
        detokenizer.add_token(int(ids[-1]))
        fed = detokenizer.last_segment
        if not fed or not tokenizer.decode([int(ids[-1])]).endswith(fed):
            detokenizer.reset()
    return detokenizer


def _responses(tokens, tokenizer, ids, limit, tic, continues: bool = False):
    detokenizer = detokenizer_after(tokenizer, [ids[-1].item()] if continues else ())
    prompt_tps, n = 0.0, 0
    for n, (token, logprobs, from_draft, stats) in enumerate(tokens, start=1):
        if n == 1:
            prompt_tps = ids.size / (time.perf_counter() - tic)
            tic = time.perf_counter()
        finish = None
        if token in tokenizer.eos_token_ids:
            finish = "stop"
        else:
            detokenizer.add_token(token)
            if n >= limit:
                finish = "length"
        if finish:
            detokenizer.finalize()
        yield GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=ids.size,
            prompt_tps=prompt_tps,
            generation_tokens=n,
            generation_tps=n / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
            accepted=stats.accepted if stats else 0,
            tau=stats.tau if stats else 0.0,
            acceptance_counts=list(stats.position_accepted) if stats else [],
            cycles=stats.cycles if stats else 0,
            block_sizes=dict(sorted(stats.block_sizes.items())) if stats else {},
            fallback=stats.fallback if stats else False,
            shadows=stats.shadows if stats else 0,
            copies=stats.copies if stats else 0,
            copied=stats.copied if stats else 0,
            trees=stats.trees if stats else 0,
            tree_nodes=stats.nodes if stats else 0,
            tree_accepted=stats.tree_accepted if stats else 0,
            chain_why=stats.chain_why if stats else None,
        )
        if finish:
            return


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


def plural(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def blocks_text(block_sizes: Dict[int, int], fallback: bool, shadows: int = 0, copies: int = 0) -> str:
    """The block-size histogram, e.g. "blocks 1x40 3x6 (12 copies, plain fallback, 8 shadow probes)"."""
    hist = " ".join(f"{b}x{n}" for b, n in sorted(block_sizes.items()))
    notes = ([plural(copies, "copy", "copies")] * (copies > 0) + ["plain fallback"] * fallback
             + [plural(shadows, "shadow probe")] * (shadows > 0))
    return f"blocks {hist}" + (f" ({', '.join(notes)})" if notes else "")


def stats_line(r: GenerationResponse) -> str:
    blocks = blocks_text(r.block_sizes, r.fallback, r.shadows, r.copies)
    tau = f"tau {r.tau:.2f} | {blocks} | " if r.cycles else ""
    return (f"{tau}generation {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s | "
            f"prompt {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | "
            f"peak memory {r.peak_memory:.3f} GB" + (f" | verify rows: {r.exactness}" if r.cycles and r.exactness else "")
            + trees_text(r))


def tree_report(r: GenerationResponse) -> dict:
    """Tree mode's statistics as the APIs report them (their dflash block's "trees")."""
    return {"trees": r.trees, "nodes_verified": r.tree_nodes, "depth_accepted": r.tree_accepted,
            "chain_why": r.chain_why}


def trees_text(r: GenerationResponse) -> str:
    """Tree mode's part of the stats line: nodes verified and depth accepted per tree."""
    if r.trees:
        return (f" | trees {r.trees}: {r.tree_nodes / r.trees:.1f} nodes, "
                f"depth {r.tree_accepted / r.trees:.2f} accepted")
    return f" | trees none ({r.chain_why})" if r.chain_why else ""
