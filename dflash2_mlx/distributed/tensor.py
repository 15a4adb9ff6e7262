"""A target split tensor-parallel over ``mx.distributed`` ranks, through mlx-lm's own
``Model.shard(group)``.

mlx-lm shards each layer's attention by heads and its MLP by the intermediate size
(``shard_linear``: the input projections all-to-sharded, the output ones sharded-to-all), so
after every layer each rank holds the full hidden state again.  That is what makes the split
invisible to DFlash: the tapped layer outputs the drafter reads are the same full rows on
every rank (no traffic for them), and the logits are the same on every rank, so the drafter,
the selector and every accept decision run replicated, each rank reaching the same tokens.

What does not divide over the group is refused before anything is sharded or sent (a
``ValueError`` naming the numbers), on every rank alike, so no rank waits on a collective
the others never issue.
"""

from dataclasses import dataclass

from ..model.target_model import model_args, text_model

# Config sizes mlx-lm's ``shard`` divides by the group size, where a family has them.
SHARDED_SIZES = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "KV heads"),
    ("intermediate_size", "MLP intermediate size"),
    ("moe_intermediate_size", "expert intermediate size"),
    ("shared_expert_intermediate_size", "shared expert intermediate size"),
    ("linear_num_value_heads", "linear-attention value heads"),
    ("linear_num_key_heads", "linear-attention key heads"),
)


@dataclass(frozen=True)
class TensorSplit:
    """What a tensor-parallel split left on the model (``model.dflash_tensor``)."""
    group: object
    rank: int
    size: int


def split_of(model):
    """The ``TensorSplit`` of a model split here, or None."""
    return getattr(model, "dflash_tensor", None)


def family(model) -> str:
    return getattr(model_args(model), "model_type", None) or type(model).__module__


def problems(model, size: int) -> list:
    """Why ``model`` cannot be split over ``size`` ranks (empty: it can)."""
    args = model_args(model)
    out = []
    for name, what in SHARDED_SIZES:
        n = getattr(args, name, None)
        if name == "num_key_value_heads" and n is None:
            continue  # the family has no separate KV heads (they are the attention heads)
        if isinstance(n, int) and n > 0 and n % size:
            out.append(f"{n} {what} ({name})")
    return out


def check(model, size: int):
    """Raise ValueError when ``model`` cannot be split tensor-parallel over ``size`` ranks;
    it issues no collective, so every rank raises alike."""
    if split_of(model) is not None or getattr(model, "dflash_stage", None) is not None:
        raise ValueError("this target is already split")
    if not hasattr(model, "shard") and not hasattr(text_model(model), "shard"):
        raise ValueError(f"a {family(model)} target cannot be split tensor-parallel: its mlx-lm model "
                         "has no shard(group); try distributed='pipeline'")
    bad = problems(model, size)
    if bad:
        raise ValueError(f"a {family(model)} target cannot be split tensor-parallel over {size} ranks: "
                         f"{', '.join(bad)} not divisible by {size}; use a group size that divides "
                         "them all, or distributed='pipeline'")


def shard(model, group) -> TensorSplit:
    """Shard ``model`` in place over ``group`` (mlx-lm's ``shard``); lazily loaded weights
    stay lazy, so evaluating the parameters afterwards keeps only this rank's slices."""
    check(model, group.size())
    owner = model if hasattr(model, "shard") else text_model(model)
    owner.shard(group)
    split = TensorSplit(group, group.rank(), group.size())
    object.__setattr__(model, "dflash_tensor", split)  # not a module attribute: no parameters
    return split
