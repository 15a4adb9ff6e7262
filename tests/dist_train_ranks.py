"""One rank of data-parallel drafter training, as tests/test_distributed_train.py launches
it (``dflash2_mlx.distributed.local.launch``).

    python tests/dist_train_ranks.py SPEC.json

SPEC: {"target": dir ("{rank}" is replaced by the rank), "drafter": dir (the starting drafter), "data": jsonl, "runs": [run]},
each run {"out": dir ("{rank}" is replaced by the rank), "config": TrainConfig fields,
"end_after": {rank: steps}, "drafter" / "data" (optional, instead of the spec's)}.  The runs go one after another in this process (one launch,
several checks).  ``end_after`` kills that rank as a rank that dies: it trains that many
steps, then the process exits with status 3 at once, before the next step's collectives
(the others are left waiting in them).  After each run every rank
prints one JSON line: {"run", "rank", "digest"} (the digest of its drafter's parameters).
"""

import json
import os
import sys

import mlx.core as mx
import mlx_lm

from dflash2_mlx.model.checkpoint import load_drafter
from dflash2_mlx.train import data, trainer
from dflash2_mlx.train.ranks import params_digest


def die_after(steps):
    """Exit (status 3, no clean-up) when step ``steps + 1`` asks for its gradients."""
    gradients, calls = trainer.Step.gradients, [0]

    def counted(self):
        calls[0] += 1
        if calls[0] > steps:
            os._exit(3)
        return gradients(self)
    trainer.Step.gradients = counted


def main(spec_path):
    spec = json.loads(open(spec_path).read())
    group = mx.distributed.init()
    rank = group.rank()
    model, _ = mlx_lm.load(spec["target"].replace("{rank}", str(rank)))
    records = data.read_dataset(spec["data"])
    for i, run in enumerate(spec["runs"]):
        cfg = trainer.TrainConfig(**run["config"])
        end_after = run.get("end_after", {}).get(str(rank))
        if end_after:
            die_after(end_after)
        drafter = load_drafter(run.get("drafter", spec["drafter"]))
        run_records = data.read_dataset(run["data"]) if "data" in run else records
        out = run["out"].replace("{rank}", str(rank))
        trained = trainer.train(model, drafter, run_records, out, cfg, group=group)
        print(json.dumps({"run": i, "rank": rank, "digest": params_digest(trained)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
