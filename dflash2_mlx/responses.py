"""What a generation yields, as mlx-lm's stream_generate yields it (``GenerationResponse``,
with the draft statistics so far), and the stats line that sums one up."""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import mlx.core as mx


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


def responses(tokens, tokenizer, ids, limit, tic, continues: bool = False):
    """mlx-lm's responses of the steps' (token, logprobs, from_draft, stats): text, rates,
    a finish reason (EOS or ``limit``), and the draft statistics so far."""
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
