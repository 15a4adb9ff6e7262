"""``dflash2-mlx train``: regenerate data with the target, then train a drafter."""

from pathlib import Path
from typing import List, Optional

import typer

# The command imports MLX and the package's modules when it runs, so that
# `dflash2-mlx --help` stays fast.


def register(app: typer.Typer):
    app.command("train")(train)


def train(
    out: Path = typer.Option(..., "--out", "-o", help="Run directory: checkpoints step-N/, final/, log.jsonl, loss.png. An existing checkpoint here is resumed."),
    data: Path = typer.Option(..., "--data", help="Dataset jsonl (prompt_ids + target response_ids). Written by --prompts, else read."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: mlx-lm model directory or hub id. Default: the built-in SmolLM2-135M-Instruct."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompt jsonl (text or chat messages): regenerate responses with the target into --data first (resumable)."),
    prompt_limit: Optional[int] = typer.Option(None, "--prompt-limit", help="Use at most this many prompts."),
    gen_max_tokens: int = typer.Option(256, "--gen-max-tokens", help="Response length when regenerating."),
    gen_temp: float = typer.Option(0.0, "--gen-temp", help="Sampling temperature when regenerating."),
    gen_batch_size: int = typer.Option(8, "--gen-batch-size", help="Prompts generated together."),
    data_only: bool = typer.Option(False, "--data-only", help="Stop after writing the dataset."),
    init: Optional[str] = typer.Option(None, "--init", help="Start from this drafter checkpoint (a v1 one with --version 2 is warm-started as DFlash 2)."),
    version: int = typer.Option(2, "--version", help="1 = DFlash, 2 = DFlash 2."),
    layers: int = typer.Option(5, "--layers", help="Drafter layers (new drafters)."),
    block_size: int = typer.Option(16, "--block-size", help="Trained block size (new drafters)."),
    target_layer_ids: Optional[List[int]] = typer.Option(None, "--target-layer", help="Tapped target layer (repeat). Default: the DFlash rule for 5 layers."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Mask token id. Default: the tokenizer's mask, else an unused embedding row, else pad."),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", help="Drafter MLP size. Default: the target's."),
    selector_rank: int = typer.Option(256, "--selector-rank"),
    selector_top_k: int = typer.Option(16, "--selector-top-k"),
    steps: int = typer.Option(1000, "--steps"),
    lr: float = typer.Option(6e-4, "--lr"),
    warmup: float = typer.Option(0.04, "--warmup", help="Warmup fraction of the steps."),
    weight_decay: float = typer.Option(0.01, "--weight-decay"),
    clip: float = typer.Option(1.0, "--clip", help="Gradient norm clip."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per micro-batch."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    max_anchors: int = typer.Option(64, "--max-anchors", help="Anchors (blocks) per sequence."),
    max_len: int = typer.Option(1024, "--max-len", help="Tokens per sequence."),
    selector_weight: float = typer.Option(1.0, "--selector-weight"),
    seed: int = typer.Option(0, "--seed"),
    save_every: int = typer.Option(0, "--save-every", help="Checkpoint every N steps (0: final only)."),
    keep: int = typer.Option(2, "--keep", help="Periodic checkpoints kept."),
    log_every: int = typer.Option(10, "--log-every"),
    feature_cache_gb: float = typer.Option(0.0, "--feature-cache-gb", help="Keep target features in a disk cache under --out/features, at most this many GB (0: compute on the fly every step). Pays off for several epochs over a small dataset."),
    val_records: int = typer.Option(0, "--val-records", help="Hold out the dataset's last N records and report val_* metrics on them (0: no held-out set)."),
    val_every: int = typer.Option(50, "--val-every", help="Steps between held-out evaluations."),
    resume: bool = typer.Option(True, "--resume/--restart", help="Continue from the latest checkpoint under --out."),
    min_block_size: int = typer.Option(0, "--min-block-size", help="Train each block at a served size drawn between this and the block size, both included (0: the trained size only)."),
    distill: float = typer.Option(0.0, "--distill", help="Weight of the KL to the target's own next-token distribution (needs the target's last layer as the last tap)."),
    stop_after: int = typer.Option(0, "--stop-after", help="End (final checkpoint) after this many steps of the --steps schedule (0: at its end)."),
    max_seconds: float = typer.Option(0.0, "--max-seconds", help="End (final checkpoint) once this run has trained this long, wherever the schedule is (0: no limit)."),
    gen_by_length: bool = typer.Option(False, "--gen-by-length", help="Regenerate in batches of prompts of one token length with plain one-token steps (fast on a GPU) instead of mlx-lm's continuous batching."),
    device: str = typer.Option("auto", "--device", help="auto (MLX's default device), cpu or gpu. On a GPU the target computes in bf16; the drafter and its loss stay fp32."),
):
    """Train a DFlash / DFlash 2 drafter for a target (data regeneration, training, checkpoints).

    Under `mlx.launch -n N -- dflash2-mlx train ...` the ranks train data-parallel: each
    takes batch-size / N sequences of every micro-batch; rank 0 logs and writes the run."""
    import mlx.core as mx
    import mlx_lm

    from ..builtin.smollm2 import default_target_path
    from ..model.checkpoint import resolve
    from ..train import TrainConfig, train_drafter
    from ..train.data import generate_by_length, generate_dataset
    from ..train.device import choose, prepare_target

    if model is None:
        model = str(default_target_path())
    if data_only:
        if prompts is None:
            raise typer.BadParameter("--data-only needs --prompts")
        try:
            device = choose(device)
        except ValueError as e:
            raise typer.BadParameter(str(e))
        target, tokenizer = mlx_lm.load(str(resolve(model)))
        prepare_target(target, device)
        make = generate_by_length if gen_by_length else generate_dataset
        n = make(target, tokenizer, prompts, data, max_tokens=gen_max_tokens,
                 temp=gen_temp, batch_size=gen_batch_size, limit=prompt_limit)
        typer.echo(f"{data}: {n} records")
        return
    cfg = TrainConfig(steps=steps, lr=lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
                      batch_size=batch_size, grad_accum=grad_accum, max_anchors=max_anchors,
                      max_len=max_len, selector_weight=selector_weight, seed=seed,
                      save_every=save_every, keep=keep, log_every=log_every,
                      feature_cache_gb=feature_cache_gb, val_records=val_records,
                      val_every=val_every, min_block_size=min_block_size, distill=distill,
                      max_seconds=max_seconds, stop_after=stop_after)
    group = mx.distributed.init()
    try:
        final = train_drafter(
            model, out, data, prompts=prompts, init=init, version=version, num_layers=layers,
            block_size=block_size, target_layer_ids=target_layer_ids or None,
            mask_token_id=mask_token_id, selector_rank=selector_rank,
            selector_top_k=selector_top_k, intermediate_size=intermediate_size,
            gen_max_tokens=gen_max_tokens, gen_temp=gen_temp, gen_batch_size=gen_batch_size,
            prompt_limit=prompt_limit, config=cfg, resume=resume, log=typer.echo, group=group,
            device=device)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    except RuntimeError as e:
        if group.size() == 1:
            raise
        typer.echo(f"error: {e}", err=True)  # a lost peer: end this rank too, non-zero
        raise typer.Exit(1)
    if group.rank() == 0:
        typer.echo(f"drafter: {final}")
