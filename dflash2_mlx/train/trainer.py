"""The training loop: AdamW, linear warmup then cosine decay, gradient clipping, gradient
accumulation, a seed, periodic checkpoints and exact resume.

A checkpoint directory ``OUT/step-000100`` (and ``OUT/final``) is a drafter in the
published format (``config.json`` + ``model.safetensors``, readable by ``load_drafter``
and by other DFlash runtimes) plus ``training_state/``: ``optimizer.safetensors`` (AdamW
moments, step, learning rate) and ``state.json`` (step, data position, the numpy RNG
state of anchor sampling and data order, the loss history, the training config).  No
pickle anywhere.  Resuming from it reproduces the run that did not stop.
"""

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..model.drafter import Drafter
from ..model.checkpoint import load_drafter, save_drafter
from ..model.target_model import text_model
from ..loop.target import Target, attach
from . import objective
from .data import sequences
from .features import FeatureCache, batch_features
from .ranks import (Ranks, agree, check_config, data_digest, digest, params_digest, ranks_of,
                    target_digest)

STATE_DIR = "training_state"


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 6e-4
    min_lr: float = 0.0
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.01
    clip: float = 1.0
    batch_size: int = 4  # sequences per micro-batch
    grad_accum: int = 1
    max_anchors: int = 64  # per sequence ("up to 512" in the recipe; CPU-sized here)
    max_len: int = 1024  # tokens per sequence
    selector_weight: float = 1.0
    min_block_size: int = 0  # > 0: each block trains as served at a size in [this, block_size]
    distill: float = 0.0  # > 0: weight of the KL to the target's own distribution (last tap = last layer)
    seed: int = 0
    save_every: int = 0  # 0: only the final checkpoint
    keep: int = 2  # periodic checkpoints kept
    log_every: int = 1
    feature_cache_gb: float = 0.0  # 0: features on the fly; else a disk cache under OUT/features
    stop_after: int = 0  # > 0: end (final checkpoint) after this many steps of a schedule over ``steps``
    val_records: int = 0  # > 0: the dataset's last N records are held out, never trained on
    val_every: int = 50  # steps between held-out evaluations (logged as val_* in the history)
    max_seconds: float = 0.0  # > 0: end (final checkpoint) once this run has trained this long


def schedule(cfg: TrainConfig):
    warm = max(1, round(cfg.warmup * cfg.steps))
    cosine = optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.min_lr)
    return optim.join_schedules([optim.linear_schedule(cfg.lr / (warm + 1), cfg.lr, warm), cosine], [warm])


def make_optimizer(cfg: TrainConfig):
    return optim.AdamW(learning_rate=schedule(cfg), weight_decay=cfg.weight_decay)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    position: int = 0  # next index into this epoch's order
    rng: dict = field(default_factory=dict)
    history: List[dict] = field(default_factory=list)


class DataStream:
    """Sequences in a seeded random order per epoch; position survives checkpoints.  A
    sequence that repeats an earlier one (a prompt asked twice, answered alike at T=0)
    is left out, as is one in ``exclude`` (token tuples)."""

    def __init__(self, records, cfg: TrainConfig, state: TrainState, exclude=frozenset()):
        self.seqs, seen = [], set(exclude)
        for i, (r, (ids, start)) in enumerate(zip(records, sequences(records, cfg.max_len))):
            if len(ids) - start >= 2 and tuple(ids) not in seen:
                seen.add(tuple(ids))
                self.seqs.append((r.get("id", i), ids, start))
        self.cfg, self.state = cfg, state

    def order(self):
        return np.random.default_rng([self.cfg.seed, self.state.epoch]).permutation(len(self.seqs))

    def next(self, n: int):
        out = []
        while len(out) < n:
            order = self.order()
            if self.state.position >= len(order):
                self.state.epoch += 1
                self.state.position = 0
                continue
            out.append(self.seqs[order[self.state.position]])
            self.state.position += 1
        return out


@dataclass
class Draws:
    """The random draws of one micro-batch: block anchors (sequence, position) and served
    block sizes (None: the trained size)."""
    seq: np.ndarray
    anchors: np.ndarray
    lengths: Optional[np.ndarray] = None


def draw(rng, seqs, cfg: TrainConfig, block_size: int) -> Draws:
    seq, anchors = objective.sample_anchors(rng, [st for _, _, st in seqs],
                                            [len(ids) for _, ids, _ in seqs], cfg.max_anchors)
    lengths = None
    if cfg.min_block_size:
        lengths = rng.integers(min(cfg.min_block_size, block_size), block_size + 1, size=len(anchors))
    return Draws(seq, anchors, lengths)


def build_blocks(target: Target, drafter: Drafter, seqs, draws: Draws, cfg: TrainConfig,
                 cache=None, share=None):
    """The blocks of ``draws``; with ``share`` (lo, hi) only those of sequences lo..hi-1
    (a rank's part of the micro-batch), whose features alone are computed."""
    seq, anchors, lengths = draws.seq, draws.anchors, draws.lengths
    if share is not None:
        lo, hi = share
        keep = (seq >= lo) & (seq < hi)
        seq, anchors = seq[keep] - lo, anchors[keep]
        lengths = None if lengths is None else lengths[keep]
        seqs = seqs[lo:hi]
    tokens = [ids for _, ids, _ in seqs]
    feats = batch_features(target, tokens, [k for k, _, _ in seqs], cache)
    c = drafter.config
    blocks = objective.make_blocks(tokens, feats, seq, anchors, c.block_size, c.mask_token_id, lengths)
    if cfg.distill:
        if c.target_layer_ids[-1] != len(target.layers) - 1:
            raise ValueError("distillation reads the target's last layer: make it the drafter's last tap")
        blocks.teacher = objective.teacher_logits(drafter, text_model(target.model).model.norm, blocks)
    return blocks


def micro_batch(target: Target, drafter: Drafter, seqs, rng, cfg: TrainConfig, cache=None):
    return build_blocks(target, drafter, seqs, draw(rng, seqs, cfg, drafter.config.block_size),
                        cfg, cache)


def validate(target: Target, drafter: Drafter, seqs, cfg: TrainConfig) -> dict:
    """Mean metrics over held-out sequences, with the same anchors every time (a fixed
    seed), so the numbers are comparable across steps and show overfitting as it happens."""
    rng = np.random.default_rng([cfg.seed, 7])
    sums, n = {}, 0
    drafter.eval()
    for i in range(0, len(seqs), cfg.batch_size):
        blocks = micro_batch(target, drafter, seqs[i : i + cfg.batch_size], rng, cfg)
        if blocks.anchors.size == 0:
            continue
        _, metrics = objective.loss(drafter, blocks, cfg.selector_weight, cfg.distill)
        mx.eval(metrics)
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.item()
        n += 1
    drafter.train()
    return {f"val_{k}": v / n for k, v in sums.items()} if n else {}


def save_checkpoint(drafter: Drafter, optimizer, state: TrainState, cfg: TrainConfig, path):
    """Drafter in the published format + training state, written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(drafter, tmp)
    (tmp / STATE_DIR).mkdir()
    mx.save_safetensors(str(tmp / STATE_DIR / "optimizer.safetensors"),
                        dict(tree_flatten(optimizer.state)))
    (tmp / STATE_DIR / "state.json").write_text(json.dumps(
        {"state": asdict(state), "config": asdict(cfg)}, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def latest_checkpoint(out_dir) -> Optional[Path]:
    """The checkpoint with the highest step under ``out_dir`` (None if there is none)."""
    best, best_step = None, -1
    for d in Path(out_dir).glob("*"):
        f = d / STATE_DIR / "state.json"
        if d.is_dir() and not d.name.endswith(".tmp") and f.is_file():
            step = json.loads(f.read_text())["state"]["step"]
            if step > best_step or (step == best_step and d.name == "final"):
                best, best_step = d, step
    return best


def load_checkpoint(path, cfg: TrainConfig):
    """(drafter, optimizer, state) to continue from checkpoint ``path``."""
    path = Path(path)
    drafter = load_drafter(str(path))
    drafter.train()
    raw = json.loads((path / STATE_DIR / "state.json").read_text())
    state = TrainState(**raw["state"])
    optimizer = make_optimizer(cfg)
    optimizer.init(drafter.trainable_parameters())
    saved = mx.load(str(path / STATE_DIR / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(saved.items()))
    return drafter, optimizer, state


def _prune(out_dir: Path, keep: int):
    steps = sorted(d for d in out_dir.glob("step-*") if d.is_dir() and not d.name.endswith(".tmp"))
    for d in steps[:-keep] if keep > 0 else steps:
        shutil.rmtree(d, ignore_errors=True)


def start(drafter: Optional[Drafter], out_dir: Path, cfg: TrainConfig, resume: bool, ranks: Ranks):
    """(drafter, optimizer, state, rng): the latest checkpoint under ``out_dir`` continued,
    or ``drafter`` new.  Every rank resumes from the same step (or none does)."""
    last = latest_checkpoint(out_dir) if resume else None
    step = -1 if last is None else json.loads((last / STATE_DIR / "state.json").read_text())["state"]["step"]
    agree(ranks, {"the checkpoint step to resume from (-1: none; the run directory must be "
                  "shared by, or copied to, every rank)": [step]})
    if last is not None:
        drafter, optimizer, state = load_checkpoint(last, cfg)
        rng = np.random.default_rng()
        rng.bit_generator.state = state.rng
        return drafter, optimizer, state, rng
    if drafter is None:
        raise ValueError(f"no checkpoint under {out_dir} to resume and no drafter given")
    drafter.train()
    return drafter, make_optimizer(cfg), TrainState(), np.random.default_rng(cfg.seed)


def split_records(records, cfg: TrainConfig, state: TrainState):
    """(training stream, held-out sequences)."""
    held = []
    if cfg.val_records > 0:
        if cfg.val_records >= len(records):
            raise ValueError(f"val_records={cfg.val_records} leaves nothing to train on "
                             f"({len(records)} records)")
        records, held = records[: -cfg.val_records], records[-cfg.val_records:]
    data = DataStream(records, cfg, state)
    if not data.seqs:
        raise ValueError("no training sequence has a response of 2 tokens or more")
    # Held out: never a sequence that is also trained on.
    held_out = DataStream(held, cfg, TrainState(), {tuple(ids) for _, ids, _ in data.seqs}).seqs
    if held and not held_out:
        raise ValueError(f"the last {cfg.val_records} records repeat training ones: nothing held out")
    return data, held_out


@dataclass
class Step:
    """What one optimizer step reads: the target, the data, the loss and the ranks."""
    target: Target
    drafter: Drafter
    data: DataStream
    rng: np.random.Generator
    cfg: TrainConfig
    ranks: Ranks
    cache: Optional[FeatureCache] = None

    def __post_init__(self):
        cfg, ranks = self.cfg, self.ranks
        self.loss = nn.value_and_grad(self.drafter, lambda b: objective.combine(
            *objective.loss_parts(self.drafter, b, cfg.selector_weight, cfg.distill),
            reduce=ranks.reduce(), scale=ranks.size))
        self.names = objective.part_names(self.drafter.version, bool(cfg.distill))
        self.weights = objective.loss_weights(self.drafter.version, cfg.selector_weight, cfg.distill)

    def empty_share(self):
        """A rank whose share of the micro-batch has no block: no gradient of its own, and
        the same all_sum of the sums and counts as every other rank."""
        zero = mx.array(0.0)
        _, metrics = objective.combine({k: (zero, zero) for k in self.names}, self.weights,
                                       reduce=self.ranks.reduce())
        return metrics, tree_map(mx.zeros_like, self.drafter.trainable_parameters())

    def gradients(self):
        """(gradient averaged over the step's non-empty micro-batches and summed over the
        ranks, metric sums, how many micro-batches); the same on every rank."""
        grads, sums, n = None, {}, 0
        for _ in range(self.cfg.grad_accum):
            seqs = self.data.next(self.cfg.batch_size)
            draws = draw(self.rng, seqs, self.cfg, self.drafter.config.block_size)
            if draws.anchors.size == 0:
                continue  # on every rank: the draws are the whole micro-batch's
            blocks = build_blocks(self.target, self.drafter, seqs, draws, self.cfg, self.cache,
                                  self.ranks.share(len(seqs)))
            if blocks.anchors.size:
                (_, metrics), g = self.loss(blocks)
            else:
                metrics, g = self.empty_share()
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(grads, metrics)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.item()
            n += 1
        if n:
            grads = self.ranks.gradients(tree_map(lambda g: g / n, grads))
        return grads, sums, n


def train(target_model, drafter: Optional[Drafter], records: List[dict], out_dir,
          cfg: TrainConfig, resume: bool = True, log: Optional[Callable[[dict], None]] = None,
          target_name: str = "", group=None):
    """Train ``drafter`` against ``target_model`` on dataset ``records``.

    With ``resume`` and a checkpoint under ``out_dir``, continue from it (``drafter`` may
    then be None).  ``target_name`` identifies the target in the feature cache's meta.
    ``group``: an ``mx.distributed`` group to train data-parallel over (see ``ranks``);
    rank 0 alone logs, evaluates and writes.  Returns the trained drafter; its history is
    in ``OUT/final``."""
    out_dir = Path(out_dir)
    ranks = ranks_of(group)
    check_config(ranks.size, cfg.batch_size, cfg.feature_cache_gb)
    if ranks.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    drafter, optimizer, state, rng = start(drafter, out_dir, cfg, resume, ranks)
    target = attach(target_model, drafter)
    data, held_out = split_records(records, cfg, state)
    agree(ranks, {"the training data": data_digest(data.seqs + held_out),
                  "the target": target_digest(target_model),
                  "the drafter's parameters": params_digest(drafter),
                  "the optimizer state": digest(*[x for kv in tree_flatten(optimizer.state) for x in kv])})
    cache = None
    if cfg.feature_cache_gb > 0:
        meta = {"target": target_name, "layers": drafter.config.target_layer_ids, "max_len": cfg.max_len}
        cache = FeatureCache(out_dir / "features", int(cfg.feature_cache_gb * 2**30), meta)
    step = Step(target, drafter, data, rng, cfg, ranks, cache)
    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after > 0 else cfg.steps
    began = time.perf_counter()
    while state.step < end:
        # A wall-clock budget (a lent GPU's minutes): every rank must stop at the same step.
        if cfg.max_seconds > 0 and ranks.stop_all(time.perf_counter() - began >= cfg.max_seconds):
            break
        tic = time.perf_counter()
        try:
            grads, sums, n = step.gradients()
        except RuntimeError as e:
            if not ranks.distributed or not any(w in str(e) for w in ("peer", "connection", "ring")):
                raise
            raise RuntimeError(f"rank {ranks.rank}: training stopped at step {state.step + 1}: "
                               f"{e} (another rank ended)") from e
        if n == 0:
            continue
        grads, norm = optim.clip_grad_norm(grads, cfg.clip)
        lr = schedule(cfg)(mx.array(state.step)).item()  # what this update uses
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state)
        state.step += 1
        state.rng = rng.bit_generator.state
        entry = {"step": state.step, **{k: v / n for k, v in sums.items()},
                 "grad_norm": norm.item(), "lr": lr, "sec": time.perf_counter() - tic}
        if not ranks.main:
            continue
        if held_out and (state.step % cfg.val_every == 0 or state.step == end):
            entry.update(validate(target, drafter, held_out, cfg))
        state.history.append(entry)
        if log and (state.step % cfg.log_every == 0 or state.step == cfg.steps):
            log(entry)
        if cfg.save_every and state.step % cfg.save_every == 0 and state.step < end:
            save_checkpoint(drafter, optimizer, state, cfg, out_dir / f"step-{state.step:06d}")
            _prune(out_dir, cfg.keep)
    state.rng = rng.bit_generator.state
    if ranks.main:
        save_checkpoint(drafter, optimizer, state, cfg, out_dir / "final")
    ranks.barrier()  # a resume on any rank straight after this run finds "final"
    drafter.eval()
    return drafter
