"""The row-exactness verdict of a target on this machine, as the service gives it: the kept
``Verdict`` (``known``), or the probe run now and kept (``verdict``); what a reply says of it
(``note``, ``exactness_of``); and, for a server listing models it has not loaded, which
verdict a checkpoint's directory loaded as (``loaded``, ``note_of_source``)."""

import sys
import time
from pathlib import Path
from typing import Optional, Tuple

from ..distributed import group_of
from ..loop.exactness import Verdict, probe
from ..machine.identity import identity
from . import keys, store

NOT_PROBED = "not probed on this machine"


def verdict(model, refresh: bool = False, try_pass: bool = True) -> Verdict:
    """The probe's verdict for ``model`` on this machine, measured once and kept (at a pair's
    first calibration, without ``try_pass``: the row-exact pass is tried when exact=True
    first needs it)."""
    kept = None if refresh else known(model)
    if kept is not None and (kept.exact or kept.exact_pass is not None or not try_pass):
        return kept
    v = probe(model, try_pass=try_pass)
    v.target, v.blas, v.machine = target_name(model), blas_name(), machine_digest()
    store.write("exactness", keys.exactness(model), v.to_json())
    return v


def known(model) -> Optional[Verdict]:
    """The kept verdict for ``model`` (None: not measured on this machine yet)."""
    return _kept(keys.exactness(model))


def _kept(key: str) -> Optional[Verdict]:
    data = store.read("exactness", key)
    try:
        return None if data is None else Verdict(**data)
    except TypeError:
        return None


def kept_verdicts():
    """Every verdict this machine keeps (``doctor``)."""
    for _, data in store.records("exactness"):
        try:
            yield Verdict(**data)
        except TypeError:
            continue


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
    if group_of(model) is None and known(model) is None:
        print("dflash2-mlx: first use: probing whether this target's verify rows are row-exact on this machine "
              "(once) ...", end=" ", file=sys.stderr, flush=True)
        tic = time.perf_counter()
        verdict(model, try_pass=False)
        print(f"done in {time.perf_counter() - tic:.0f} s", file=sys.stderr, flush=True)


def probe_if_owed(policy, model) -> bool:
    """At the end of the reply (or batch) ``policy`` served: where its costs were measured by
    this process at the pair's first use, the exactness probe runs now, once (``at_first_use``:
    the first token waited for the costs only).  Whether it ran."""
    costs = getattr(policy, "costs", None)
    costs = getattr(costs, "costs", costs)  # under the live timing's (or a batch's) pricing
    if not getattr(costs, "first_use", False):
        return False
    costs.first_use = False
    at_first_use(model)
    return True


def note(model) -> str:
    """What a reply says of ``model``'s verify rows here: the kept verdict, or NOT_PROBED."""
    v = known(model) if model is not None else None
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


# A verdict is keyed by the loaded model's weights; a server lists models it has not loaded
# yet.  Each load therefore notes which key the files it read give on this machine, so that a
# listing can name the verdict of a model this machine has loaded before (by any surface).


def source_of(target_dir, adapter_path=None) -> dict:
    """What a load read: the target's directory and its config, and the adapters."""
    target_dir = Path(target_dir)
    try:
        config = (target_dir / "config.json").read_text()
    except OSError:
        config = None
    return {"target": str(target_dir.resolve()), "config": config and store.digest(config),
            "adapters": str(Path(adapter_path).resolve()) if adapter_path else None}


def loaded(model, source: dict):
    """Note that ``source`` loads as ``model`` on this machine (see ``note_of_source``)."""
    key, at = keys.exactness(model), keys.source(source)
    if (store.read("source", at) or {}).get("key") != key:
        store.write("source", at, {"key": key})


def note_of_source(source: dict) -> str:
    """``note`` for a model not loaded in this process: the verdict kept for what ``source``
    loaded as when this machine last loaded it, else NOT_PROBED."""
    key = (store.read("source", keys.source(source)) or {}).get("key")
    v = _kept(key) if isinstance(key, str) else None
    return NOT_PROBED if v is None else v.describe()
