"""The verify modes: one table, and the one place their names (aliases included) are
resolved; ``dflash2_mlx.plan`` and the server's model settings read it."""

# A verify mode as users name it -> how blocks are verified: "chain" (a drafted block),
# "tree" (trees of drafted paths) or "off" (plain decoding).  "adaptive" is a chain whose
# block size is chosen every cycle, a number given as its largest; "ddtree" is oMLX's name.
MODES = {"dflash": "chain", "adaptive": "chain", "tree": "tree", "ddtree": "tree", "off": "off"}
VERIFY_MODES = tuple(MODES)
MAX_BUDGET = 64  # the most nodes a tree may verify in one pass (besides the anchor)


def verify_kind(mode: str) -> str:
    """"chain", "tree" or "off" for a verify mode, or a clear error."""
    if mode not in MODES:
        raise ValueError(f"verify mode {mode!r} is not supported; use one of {VERIFY_MODES}")
    return MODES[mode]
