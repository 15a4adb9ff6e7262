"""One rank of a pipelined pair (``distributed.pipeline``), run by
``tests/test_distributed_pipeline.py`` through ``distributed.local.launch``.

Argument: a JSON object {"target": path or null (the built-in pair), "draft": path or null,
"runs": [{"prompt", "max_tokens", "block_size", "temp", "seed", "lookup"}, ...]}.  Every rank
prints one JSON line per run: the rank, its tokens, and the collectives the run issued
(all_sum / all_gather shapes), then a line with the layers it holds and the memory its
weights take once loaded.
"""

import json
import sys
from collections import defaultdict

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash2_mlx.distributed import pipeline
from dflash2_mlx.generate import load, stream_generate


class Shapes:
    """The shapes of the arrays given to ``mx.distributed``'s all_sum and all_gather while
    installed (the calls go on to MLX's own functions)."""

    def __init__(self):
        self.seen, self.originals = defaultdict(list), {}

    def install(self):
        for op in ("all_sum", "all_gather"):
            fn = self.originals[op] = getattr(mx.distributed, op)

            def counted(x, *a, _op=op, _fn=fn, **kw):
                self.seen[_op].append(list(x.shape))
                return _fn(x, *a, **kw)

            setattr(mx.distributed, op, counted)

    def uninstall(self):
        for op, fn in self.originals.items():
            setattr(mx.distributed, op, fn)


def load_split(target, draft):
    """The pair through the public entry point (``load(..., distributed="pipeline")``: the
    target loaded lazily, checked against the drafter whole, split, then only this rank's
    weights evaluated), and the memory its weights take once loaded."""
    model, tokenizer, drafter = load(target, draft, distributed="pipeline")
    memory = {"rank_bytes": nbytes(model), "drafter_bytes": nbytes(drafter),
              "active_bytes": mx.get_active_memory()}
    return model, tokenizer, drafter, memory


def nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def main(cfg: dict):
    model, tokenizer, drafter, memory = load_split(cfg.get("target"), cfg.get("draft"))
    stage = pipeline.stage_of(model)
    group = stage.group
    for run in cfg["runs"]:
        shapes = Shapes()
        shapes.install()
        try:
            tokens = [r.token for r in stream_generate(
                model, tokenizer, run["prompt"], drafter, max_tokens=run["max_tokens"],
                block_size=run["block_size"], temp=run.get("temp", 0.0), seed=run.get("seed"),
                lookup=run.get("lookup", True))]
        finally:
            shapes.uninstall()
        print(json.dumps({"rank": group.rank(), "tokens": tokens, **shapes.seen}), flush=True)
    layers = sorted({int(k.split(".")[k.split(".").index("layers") + 1])
                     for k, _ in tree_flatten(model.parameters()) if ".layers." in f".{k}"})
    print(json.dumps({"rank": group.rank(), "start": stage.start, "stop": stage.stop,
                      "param_layers": len(layers), **memory}), flush=True)


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except Exception as e:  # a clear line for the test, and a non-zero exit (no hang)
        print(f"rank error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
