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
one pass) against the same one-row steps.  ``verdict`` runs it once per (target, machine,
backend) and keeps it beside the cost calibration.  ``exact=True`` (``generate``,
``--exact``) then costs nothing where the verdict is "exact"; elsewhere each verify pass is
the row-exact pass where the probe found it bit-identical to one-row steps, else one-row
steps (``Target.verify_pass``).
"""

from dataclasses import asdict, dataclass, field
from typing import Iterable, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..adaptive import store
from ..machine.identity import identity
from .target import Target

PROBE = 2  # bump when the probe changes what it measures
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
        for b in rows:
            c = fresh()
            many = verify.exact_pass(rest[:, :b], c)[0][0].astype(mx.float32)
            d = float(mx.max(mx.abs(many - one[:b])).item())
            if trimmable:
                for layer in c:
                    layer.trim(b)
            if d:
                return False, f"{b} rows: max |d| {d:.3g}"
    except Exception as e:  # a family whose layers the pass cannot run row by row
        return False, f"{type(e).__name__}: {e}"
    return True, ""



def _key(model) -> str:
    from ..adaptive.costs import shapes

    return store.digest({"probe": PROBE, "target": shapes(model), "machine": identity()})


def verdict(model, refresh: bool = False, try_pass: bool = True) -> Verdict:
    """The probe's verdict for ``model`` on this machine, measured once and kept under the
    cache home (``adaptive/exact-*.json``) as the cost calibration is (at a pair's first
    calibration, without ``try_pass``: the row-exact pass is tried when exact=True first
    needs it)."""
    path = store.cache_dir() / f"exact-{_key(model)}.json"
    kept = None if refresh else known(model)
    if kept is not None and (kept.exact or kept.exact_pass is not None or not try_pass):
        return kept
    v = probe(model, try_pass=try_pass)
    v.target, v.blas, v.machine = target_name(model), blas_name(), machine_digest()
    store.write(path, v.to_json())
    return v


def target_name(model) -> str:
    """A target as a verdict names it: its family, width x depth."""
    args = getattr(getattr(model, "language_model", model), "args", None)
    if args is None:
        return type(model).__module__.rsplit(".", 1)[-1]
    return (f"{getattr(args, 'model_type', '?')} {getattr(args, 'hidden_size', '?')}x"
            f"{getattr(args, 'num_hidden_layers', '?')}")


def blas_name() -> str:
    """What computes this process's matmuls: the GPU, a preloaded BLAS, or MLX's own."""
    ident = identity()
    if "gpu" in ident["device"]:
        return ident.get("gpu") or "GPU"
    return ident["blas"] or "MLX's bundled BLAS"


def machine_digest() -> str:
    return store.digest(identity())


def at_first_use(model) -> None:
    """Probe ``model`` at the end of the reply its pair's first cost calibration was made
    for, unless it was already (a one-machine target: a split target's ranks would have to
    probe in step)."""
    import sys
    import time

    from ..distributed import group_of

    if group_of(model) is None and known(model) is None:
        print("dflash2-mlx: first use: probing whether this target's verify rows are row-exact on this machine "
              "(once) ...", end=" ", file=sys.stderr, flush=True)
        tic = time.perf_counter()
        verdict(model, try_pass=False)
        print(f"done in {time.perf_counter() - tic:.0f} s", file=sys.stderr, flush=True)


NOT_PROBED = "not probed on this machine"


def note(model) -> str:
    """What a reply says of ``model``'s verify rows here: the kept verdict, or NOT_PROBED."""
    v = known(model) if model is not None else None
    return NOT_PROBED if v is None else v.describe()


def known(model) -> Optional[Verdict]:
    """The kept verdict for ``model`` (None: not measured on this machine yet)."""
    return _kept(_key(model))


def _kept(key: str) -> Optional[Verdict]:
    data = store.read(store.cache_dir() / f"exact-{key}.json")
    try:
        return None if data is None else Verdict(**data)
    except TypeError:
        return None


# A verdict is keyed by the loaded model's weights; a server lists models it has not loaded
# yet.  Each load therefore notes which key the files it read give on this machine, so that a
# listing can name the verdict of a model this machine has loaded before (by any surface).


def _source_key(source: dict) -> str:
    return store.digest({"probe": PROBE, "source": source, "machine": identity()})


def source_of(target_dir, adapter_path=None) -> dict:
    """What a load read: the target's directory and its config, and the adapters."""
    from pathlib import Path

    target_dir = Path(target_dir)
    try:
        config = (target_dir / "config.json").read_text()
    except OSError:
        config = None
    return {"target": str(target_dir.resolve()), "config": config and store.digest(config),
            "adapters": str(Path(adapter_path).resolve()) if adapter_path else None}


def loaded(model, source: dict):
    """Note that ``source`` loads as ``model`` on this machine (see ``note_of_source``)."""
    path = store.cache_dir() / f"source-{_source_key(source)}.json"
    key = _key(model)
    if (store.read(path) or {}).get("key") != key:
        store.write(path, {"key": key})


def note_of_source(source: dict) -> str:
    """``note`` for a model not loaded in this process: the verdict kept for what ``source``
    loaded as when this machine last loaded it, else NOT_PROBED."""
    key = (store.read(store.cache_dir() / f"source-{_source_key(source)}.json") or {}).get("key")
    v = _kept(key) if isinstance(key, str) else None
    return NOT_PROBED if v is None else v.describe()


def exactness_of(model, exact: bool) -> Tuple[str, Optional[str]]:
    """(what a response says of its exactness, how verify rows are made exact: None where
    passes are row-exact already or exactness was not asked, "pass" for a row-exact pass,
    "steps" for one-row steps).  With ``exact`` the probe runs now if this machine has no
    verdict for the target yet."""
    v = verdict(model) if exact else known(model)  # probes the pass if untried
    if v is None:
        return f"{NOT_PROBED} (dflash2-mlx doctor --exact)", None
    if v.exact:
        return "exact", None
    if exact and v.exact_pass:
        return f"exact, by the exact mode's row-exact verify pass (ordinary passes here are {v.describe()})", "pass"
    if exact:
        return f"exact, by the exact mode's one-row verify (ordinary passes here are {v.describe()})", "steps"
    return (f"{v.describe()}: greedy output may leave plain decoding's where two tokens nearly tie "
            "(the exact mode rules that out: --exact, exact=True, dflash_exact)"), None
