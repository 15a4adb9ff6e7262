"""Is a verify pass row-exact on this machine?  The probe, its verdict and where it is kept.

"Greedy output is the target's own" needs more than the accept rule: the logits a verify
pass computes for row i must be, bit for bit, the logits a one-row decode step computes for
the same token.  A pass over b rows may take other kernels than a one-row step (MLX's
quantized matmul picks its kernel by row count; a GPU tiles a b-row product), which sum in
another order; the rows then differ in their last bits, and where two tokens nearly tie the
argmax can flip.  On this CPU in fp32 they are bit-identical with MLX's bundled BLAS and
not with OpenBLAS (a different kernel for one row); on a GPU they were not (docs/lossless.md).

``probe`` measures it on the real target: after the same prompt, a pass over b rows
against the same b tokens decoded one row at a time, for each row count the loop may use.
It also tries the row-exact pass (``exact_pass.py``: products and attention row by row in
one pass) against the same one-row steps.  The calibration service runs it once per
(target, machine, backend) and keeps the ``Verdict`` (``calibration/exactness.py``).
``exact=True`` (``generate``, ``--exact``) then costs nothing where the verdict is "exact";
elsewhere each verify pass is the row-exact pass where the probe found it bit-identical to
one-row steps, else one-row steps (``verifiers.py``).
"""

from dataclasses import asdict, dataclass, field
from typing import Iterable, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .target import Target
from .verifiers import RowExactPass

ROWS = tuple(range(2, 17))  # every block size the loop drafts (copies verify up to 16 rows)


@dataclass
class Verdict:
    """What the probe found: per row count, whether every row was bit-identical to its
    one-row step; overall the largest |difference| of a logit, the share of logits that
    differ, and how many rows' argmax moved."""
    exact: bool
    rows: List[int] = field(default_factory=list)
    inexact_rows: List[int] = field(default_factory=list)  # row counts with a differing row
    max_abs_diff: float = 0.0
    differing: float = 0.0  # share of the compared logits that differ
    argmax_flips: int = 0
    rows_compared: int = 0
    dtype: str = ""
    device: str = ""
    # Whether the row-exact pass gave one-row steps' bits for every row count (None: not
    # tried yet; a first use's probe leaves it to the first exact=True), else what it found.
    exact_pass: Optional[bool] = None
    exact_pass_note: str = ""
    # What it holds for: the target (family, width x depth), the BLAS (or GPU) that ran it,
    # and this machine's identity (a digest): a verdict under another BLAS is another one.
    target: str = ""
    blas: str = ""
    machine: str = ""

    def setup(self) -> str:
        """The target, dtype, device and BLAS the verdict holds for, in words."""
        return ", ".join(x for x in (self.target, f"{self.dtype} weights" if self.dtype else "", self.device,
                                     self.blas or "BLAS not recorded") if x)

    def describe(self) -> str:
        if self.exact:
            return "exact"
        return (f"not row-exact on this machine (max |d| {self.max_abs_diff:.3g}, "
                f"argmax flips {self.argmax_flips}/{self.rows_compared} rows)")

    def to_json(self) -> dict:
        return asdict(self)


def probe(model, rows: Iterable[int] = ROWS, prompt_tokens: int = 48, seed: int = 0,
          try_pass: bool = True) -> Verdict:
    """Verify passes over each of ``rows`` tokens against one-row steps, on ``model``.  One
    step's logits depend only on the tokens before it, so the one-row steps run once, over
    the most rows, and every pass is compared with the first rows of them."""
    rows = sorted(set(int(b) for b in rows if b >= 2))
    if not rows:
        raise ValueError("the probe needs a row count of 2 or more")
    vocab = getattr(getattr(model, "language_model", model), "args").vocab_size
    rng = np.random.default_rng(seed)
    # Ordinary tokens (the first hundreds of a vocabulary are often control tokens).
    ids = mx.array(rng.integers(min(1000, vocab // 2), vocab, size=prompt_tokens + rows[-1]), dtype=mx.int32)
    prompt, rest = ids[None, :prompt_tokens], ids[None, prompt_tokens:]
    # Passes over several rows go through the loop's own target adapter (on this CPU it
    # splits their products over two streams); one-row steps are mlx-lm's plain model call.
    verify = Target(model, [0])
    cache = make_prompt_cache(model)
    trimmable = all(c.is_trimmable() for c in cache)

    def fresh():
        nonlocal cache
        if not trimmable:  # recurrent layers cannot be rewound: read the prompt again
            cache = make_prompt_cache(model)
            mx.eval(model(prompt, cache=cache))
        return cache

    mx.eval(model(prompt, cache=cache))
    one = [model(rest[:, i : i + 1], cache=cache)[0] for i in range(rest.shape[1])]
    one = mx.concatenate(one, axis=0)
    mx.eval(one)
    if trimmable:
        for c in cache:
            c.trim(rest.shape[1])
    v = Verdict(exact=True, rows=rows, dtype=str(one.dtype).split(".")[-1], device=str(mx.default_device()))
    one = one.astype(mx.float32)
    diff_count = total = 0
    for b in rows:
        c = fresh()
        many = verify(rest[:, :b], c)[0][0].astype(mx.float32)
        d = mx.abs(many - one[:b])
        ndiff = int(mx.sum(d > 0).item())
        diff_count, total = diff_count + ndiff, total + d.size
        v.max_abs_diff = max(v.max_abs_diff, float(mx.max(d).item()))
        v.argmax_flips += int(mx.sum(mx.argmax(many, -1) != mx.argmax(one[:b], -1)).item())
        v.rows_compared += b
        if ndiff:
            v.exact = False
            v.inexact_rows.append(b)
        if trimmable:
            for layer in c:
                layer.trim(b)
    v.differing = diff_count / max(total, 1)
    if try_pass:
        v.exact_pass, v.exact_pass_note = _try_exact_pass(verify, rest, one, rows, fresh, trimmable)
    return v


def _try_exact_pass(verify: Target, rest, one, rows, fresh, trimmable) -> tuple:
    """(whether the row-exact pass gave one-row steps' bits at every row count, what it found)."""
    try:
        row_exact = RowExactPass(verify)
        for b in rows:
            c = fresh()
            many = row_exact(rest[:, :b], c)[0][0].astype(mx.float32)
            d = float(mx.max(mx.abs(many - one[:b])).item())
            if trimmable:
                for layer in c:
                    layer.trim(b)
            if d:
                return False, f"{b} rows: max |d| {d:.3g}"
    except Exception as e:  # a family whose layers the pass cannot run row by row
        return False, f"{type(e).__name__}: {e}"
    return True, ""
