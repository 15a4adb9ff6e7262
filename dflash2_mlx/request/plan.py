"""One plan per request: what the caller asked for, validated once at the boundary and read
as it stands from there on (verify modes resolved by ``modes.py``), and the checks of the
block size and the tree budget it takes."""

from dataclasses import dataclass, field, fields
from typing import Callable, List, Optional, Union

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from .arguments import check_all
from .modes import MAX_BUDGET, verify_kind
from .sampling import SamplingParams

AUTO = "auto"  # a block size chosen every cycle, or a tree budget sized by the cost curve


def check_block_size(drafter, block_size: Union[int, str, None]) -> Union[int, str]:
    """A block size in 1..the drafter's trained size, or "auto" (also for None)."""
    trained = drafter.config.block_size
    if block_size is None or block_size == AUTO:
        return AUTO
    if isinstance(block_size, str) and block_size.isdigit():
        block_size = int(block_size)
    if not isinstance(block_size, int) or not 1 <= block_size <= trained:
        raise ValueError(
            f"block size {block_size!r} is impossible for this drafter: "
            f"use 1..{trained} (its trained block size) or 'auto'"
        )
    return block_size


def check_budget(budget: Union[int, str, None]) -> Union[int, str]:
    """A tree budget as given (a number of nodes, or "auto"), or a clear error."""
    if budget is None or budget == AUTO:
        return AUTO
    if isinstance(budget, str) and budget.isdigit():
        budget = int(budget)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"tree budget {budget!r} is impossible: give a number of nodes from 1 to "
                         f"{MAX_BUDGET}, or 'auto'")
    return budget


@dataclass(frozen=True)
class Plan:
    """How one request is decoded.  ``verify``: "chain", "tree" or "off"; ``block_size``: a
    number, or "auto" (chosen every cycle, up to ``largest``: None for the drafter's trained
    size); ``tree_budget``: a tree's nodes (a number or "auto"), with ``verify="tree"`` only.
    The rest are ``stream_generate``'s arguments of the same names."""
    verify: str = "chain"
    block_size: Union[int, str] = AUTO
    largest: Optional[int] = None
    tree_budget: Union[int, str, None] = None
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    seed: Optional[int] = None
    exact: bool = False
    lookup: bool = True
    continues: bool = False
    draft_window: Optional[int] = None
    draft_sink: int = 0
    cost_file: Optional[str] = None
    # As mlx-lm's generate_step takes them (``mlx_lm_args``):
    logits_processors: Optional[List[Callable]] = None
    prefill_step_size: int = 2048
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START

    @classmethod
    def of(cls, drafter=None, verify_mode: str = "dflash", block_size=AUTO, tree_budget=None, **asked) -> "Plan":
        """The plan of ``stream_generate``'s keyword arguments (its sampling arguments are
        ``SamplingParams``'); the block size is checked against ``drafter`` where one drafts."""
        check_all(**{k: asked.get(k) for k in ("max_tokens", "seed", "exact", "lookup", "continues")})
        kind = verify_kind(verify_mode)
        if tree_budget is not None and kind != "tree":
            raise ValueError(f"tree_budget={tree_budget!r} needs verify_mode='tree' (got {verify_mode!r})")
        if kind == "tree":
            tree_budget = check_budget(tree_budget)
        verify = kind if drafter is not None else "off"
        sampling = {f.name for f in fields(SamplingParams)}
        given = {k: asked.pop(k) for k in list(asked) if k in sampling}
        params = SamplingParams(**{k: v for k, v in given.items() if v is not None})
        largest = None
        if verify != "off":
            block_size = check_block_size(drafter, block_size)
            largest = None if block_size == AUTO else block_size
            if verify_mode == "adaptive":
                block_size = AUTO
        return cls(verify=verify, block_size=block_size, largest=largest, tree_budget=tree_budget,
                   params=params, **asked)

    @property
    def auto(self) -> bool:
        """Whether the block size is chosen every cycle."""
        return self.block_size == AUTO

    @property
    def limit(self):
        """The most tokens to yield (-1 and 0: no limit)."""
        return self.max_tokens if self.max_tokens > 0 else float("inf")

    def mlx_lm_args(self) -> dict:
        """What both kinds of decoding take, under the names of mlx-lm's generate_step."""
        return dict(logits_processors=self.logits_processors, prefill_step_size=self.prefill_step_size,
                    kv_bits=self.kv_bits, kv_group_size=self.kv_group_size,
                    quantized_kv_start=self.quantized_kv_start)


@dataclass
class Reuse:
    """A reused prefix: ``prompt_cache`` (and with DFlash ``draft_context``) already hold the
    prompt's first ``cached_tokens`` (``stream_generate``'s arguments of those names)."""
    prompt_cache: Optional[list] = None
    draft_context: Optional[object] = None
    cached_tokens: int = 0
