"""``dflash2-mlx bench``: plain decoding vs DFlash v1 vs DFlash 2 on the benchmark
prompt sets (the default), and ``dflash2-mlx bench kernels``."""

from pathlib import Path
from typing import List, Optional

import typer

# The commands import MLX and the package's modules when they run, so that
# `dflash2-mlx --help` stays fast.

bench_app = typer.Typer(
    help="Benchmarks: `bench` (plain vs DFlash v1 vs DFlash 2 on real prompts), `bench serve` (the server under concurrent clients), `bench agent` (an agent session through each API), `bench distributed` (a target split over ranks), `bench soak` (the server for an hour of mixed traffic with faults) and `bench kernels`.",
    invoke_without_command=True, add_completion=False,
)


def register(app: typer.Typer):
    app.add_typer(bench_app, name="bench")


def report_of(run, markdown, write_report, out: Path):
    """Run a benchmark (``run()``), print its markdown and write its report under ``out``;
    a ValueError or RuntimeError (a bad setup, a server or a rank that failed) exits 2."""
    try:
        report = run()
    except (ValueError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    paths = write_report(report, out)
    typer.echo(markdown(report))
    typer.echo("wrote " + ", ".join(str(p) for p in paths), err=True)


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    samples: int = typer.Option(1, "--samples", "-n", help="Prompts drawn at random from each prompt set (1: about 7 minutes on a 2-core x86 CPU with OpenBLAS)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens generated per run."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="Block size of the fixed-block rows (default 5, at most the drafters' trained size)."),
    sweep: List[int] = typer.Option([], "--sweep", help="More fixed block sizes for the DFlash 2 drafter (repeat), to compare the adaptive row with the best fixed one."),
    adaptive: bool = typer.Option(True, "--adaptive/--no-adaptive", help="Add a row running the DFlash 2 drafter with adaptive speculation (block size auto)."),
    copies: bool = typer.Option(True, "--copies/--no-copies", help="Add the DFlash 2 fixed and adaptive rows again with copies where the sequence repeats itself (generate's default; the other rows draft every block)."),
    temps: List[float] = typer.Option([0.0, 1.0], "--temp", help="Temperatures; repeat."),
    trees: List[int] = typer.Option([], "--tree", help="Add a row verifying DFlash 2 trees of this many nodes (as deep as the fixed block; repeat, e.g. --tree 8 --tree 16 --tree 32)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target directory or hub id. Default: the built-in SmolLM2-135M-Instruct (then the drafters default to the shipped ones)."),
    drafter_v2: Optional[str] = typer.Option(None, "--drafter-v2", help="DFlash 2 drafter. Default with the built-in target: the shipped one."),
    drafter_v1: Optional[str] = typer.Option(None, "--drafter-v1", help="DFlash v1 drafter. Default with the built-in target: the shipped comparison drafter."),
    no_v1: bool = typer.Option(False, "--no-v1", help="Skip the DFlash v1 column."),
    bench_files: List[Path] = typer.Option([], "--bench", "-b", help="Prompt jsonl; repeat. Default: the five sets shipped with the package (GSM8K, MATH-500, HumanEval, MBPP, MT-Bench), or those in $DFLASH2_MLX_BENCH_DIR."),
    out: Path = typer.Option(Path("bench-out"), "--out", "-o", help="Report directory: bench.json, bench.md, speed.png, acceptance.png."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt sample and of sampling."),
):
    """Plain mlx-lm decoding, DFlash v1 and DFlash 2 side by side at T=0 and T=1: tau,
    tok/s, speed-up, per-position acceptance, and a T=0 token-for-token parity check."""
    if ctx.invoked_subcommand is not None:
        return
    import mlx_lm

    from ..builtin.bench_sets import default_bench_files
    from ..builtin.defaults import default_pair, default_v1_drafter
    from ..eval.bench import markdown, run_bench, write_report
    from ..eval.prompts import sample_prompts
    from ..model.checkpoint import load_drafter, resolve

    if model is None:
        model, shipped_v2 = default_pair()
        drafter_v2 = drafter_v2 or shipped_v2
        drafter_v1 = drafter_v1 or (None if no_v1 else default_v1_drafter())
    if no_v1:
        drafter_v1 = None
    if drafter_v1 is None and drafter_v2 is None:
        raise typer.BadParameter("with --model, give --drafter-v2 and/or --drafter-v1")
    if not bench_files:
        try:
            bench_files = default_bench_files()
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
    target, tokenizer = mlx_lm.load(str(resolve(model)))
    drafters = {}
    for label, path in (("DFlash v1", drafter_v1), ("DFlash 2", drafter_v2)):
        if path is None:
            continue
        try:
            drafters[label] = load_drafter(path, target=target)
        except ValueError as e:
            typer.echo(f"error: {label} drafter {path}: {e}", err=True)
            raise typer.Exit(2)
    if drafter_v1 is None:
        typer.echo("note: no DFlash v1 drafter: the v1 column is skipped", err=True)
    benches = sample_prompts(bench_files, samples, seed)
    try:
        report = run_bench(target, tokenizer, drafters, benches, temps=temps, max_tokens=max_tokens,
                           block_size=block_size, adaptive=adaptive, seed=seed, sweep=sweep, copies=copies,
                           trees=trees, log=lambda s: typer.echo(s, err=True))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    report["config"].update(target=str(model), drafter_paths={"DFlash v1": drafter_v1, "DFlash 2": drafter_v2})
    paths = write_report(report, out)
    typer.echo(markdown(report))
    typer.echo("wrote " + ", ".join(str(p) for p in paths), err=True)
    if report["mismatches"]:
        typer.echo(f"!!! {len(report['mismatches'])} T=0 output(s) differ from plain decoding "
                   f"(see {out / 'bench.md'})", err=True)
        raise typer.Exit(1)


@bench_app.command("serve")
def serve(
    streams: List[int] = typer.Option([1, 2, 4, 8], "--streams", "-s", help="Concurrent streaming clients per row; repeat."),
    requests: int = typer.Option(4, "--requests", "-n", help="Requests each client sends, one after another."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="max_tokens of every request."),
    max_batch: int = typer.Option(8, "--max-batch", help="The batched server's --max-batch."),
    baseline_streams: List[int] = typer.Option([], "--baseline-streams", help="Stream counts also run on the one-at-a-time server (--max-batch 1); repeat. Default: the smallest and the largest of --streams."),
    temp: float = typer.Option(0.0, "--temp", help="Temperature of every request (at 0 the two servers' replies are compared)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="A fixed block size for both servers (default: auto)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target directory or hub id (with --draft). Default: the built-in SmolLM2-135M-Instruct and its shipped DFlash 2 drafter."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="The drafter for --model."),
    bench_files: List[Path] = typer.Option([], "--bench", "-b", help="Prompt jsonl; repeat. Default: the five shipped prompt sets."),
    out: Path = typer.Option(Path("bench-serve-out"), "--out", "-o", help="Report directory: bench-serve.json, bench-serve.md (and the servers' logs)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt sample."),
):
    """The server under 1, 2, 4, 8 concurrent streaming clients: continuous batching against
    one request at a time, side by side (aggregate and per-stream tok/s, τ, p50/p95 latency)."""
    from ..eval.bench_serve import markdown, run_serve_bench, write_report

    if model is not None and draft is None:
        raise typer.BadParameter("--model needs --draft (the drafter both servers use)")
    if min(streams) < 1 or requests < 1 or max_tokens < 1 or max_batch < 2:
        raise typer.BadParameter("--streams, --requests and --max-tokens must be >= 1, --max-batch >= 2")
    report_of(lambda: run_serve_bench(model=model, draft=draft, streams=streams, requests=requests,
                             max_tokens=max_tokens, max_batch=max_batch,
                             baseline_streams=baseline_streams or None, temp=temp,
                             bench_files=bench_files, seed=seed, block_size=block_size,
                             work_dir=out, log=lambda s: typer.echo(s, err=True)), markdown, write_report, out)


@bench_app.command("agent")
def agent(
    apis: List[str] = typer.Option(["openai-chat", "anthropic", "responses", "ollama"], "--api", help="Wire formats the DFlash sessions go through; repeat (openai-chat, anthropic, responses, ollama)."),
    max_tokens: int = typer.Option(48, "--max-tokens", help="Tokens of each reply (T=0)."),
    result_tokens: List[int] = typer.Option([], "--result-tokens", help="Tokens of each turn's tool result; repeat (default: 10 turns of 250-1600 tokens, about 7k in all)."),
    mlx_lm: bool = typer.Option(True, "--mlx-lm/--no-mlx-lm", help="Also run the session on mlx_lm.server (plain, mlx-lm's prompt cache)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target directory (with --draft). Default: the built-in SmolLM2-135M-Instruct and its shipped DFlash 2 drafter."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="The drafter for --model."),
    out: Path = typer.Option(Path("bench-agent-out"), "--out", "-o", help="Report directory: bench-agent.json, bench-agent.md (and the servers' logs)."),
):
    """An agent session (tools, 8-12 turns, tool results growing the context) replayed
    through each API on DFlash, on plain decoding with no prefix cache, and on mlx_lm.server,
    one server at a time: time to first token, decode tok/s and τ per turn."""
    from ..eval.bench_agent import APIS, RESULT_TOKENS, markdown, run_agent_bench, write_report

    if model is not None and draft is None:
        raise typer.BadParameter("--model needs --draft (the drafter the DFlash server uses)")
    unknown = [a for a in apis if a not in APIS]
    if unknown or max_tokens < 2 or any(n < 1 for n in result_tokens):
        raise typer.BadParameter(f"--api is one of {', '.join(APIS)}; --max-tokens >= 2; --result-tokens >= 1")
    report_of(lambda: run_agent_bench(model=model, draft=draft, apis=apis, max_tokens=max_tokens,
                             sizes=result_tokens or RESULT_TOKENS, mlx_lm=mlx_lm, work_dir=out,
                             log=lambda s: typer.echo(s, err=True)), markdown, write_report, out)


@bench_app.command("distributed")
def distributed(
    mode: str = typer.Option("tensor", "--mode", help="How the target is split: tensor or pipeline."),
    ranks: int = typer.Option(3, "--ranks", "-n", help="Ranks launched on this machine (127.0.0.1, ring backend). The built-in target's 9 heads / 3 KV heads split over 3 for tensor."),
    samples: int = typer.Option(1, "--samples", help="Prompts drawn from each of the five shipped prompt sets."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens per prompt."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="A fixed block size (default: auto)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target directory (with --draft). Default: the built-in pair."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="The drafter for --model."),
    out: Path = typer.Option(Path("bench-distributed-out"), "--out", "-o", help="Report directory."),
    timeout: float = typer.Option(1800.0, "--timeout", help="Seconds the ranks may run in all."),
):
    """Plain and DFlash decoding on a target split over local ranks, side by side: tok/s,
    collectives and bytes per token, communication time, and the speed-up modelled on
    Thunderbolt 5 and 10 GbE links."""
    from ..eval.bench_distributed import markdown, run_distributed_bench, write_report

    if mode not in ("tensor", "pipeline"):
        raise typer.BadParameter("--mode is tensor or pipeline")
    if ranks < 2 or samples < 1 or max_tokens < 1:
        raise typer.BadParameter("--ranks must be >= 2, --samples and --max-tokens >= 1")
    if model is not None and draft is None:
        raise typer.BadParameter("--model needs --draft")
    report_of(lambda: run_distributed_bench(mode=mode, ranks=ranks, model=model, draft=draft, samples=samples,
                                   max_tokens=max_tokens, block_size=block_size, timeout=timeout,
                                   log=lambda s: typer.echo(s, err=True)), markdown, write_report, out)


@bench_app.command("soak")
def soak(
    minutes: float = typer.Option(60.0, "--minutes", help="How long the clients send traffic."),
    clients: int = typer.Option(6, "--clients", "-c", help="Concurrent clients (threads), each a seeded mix of APIs, requests and faults."),
    seed: int = typer.Option(0, "--seed", help="Seed of the inputs and of every client's mix."),
    max_tokens: int = typer.Option(40, "--max-tokens", help="max_tokens of the checked requests."),
    kill: bool = typer.Option(True, "--kill/--no-kill", help="kill -9 the server once (at 60% of the run) and restart it."),
    out: Path = typer.Option(Path("soak-out"), "--out", "-o", help="Report directory: soak.json, soak.md, soak.png, the server's log, its home and disk tier."),
):
    """The server on the built-in pair under an agent setup's mixed traffic for an hour, with
    faults (hang-ups, bad and oversize requests, a settings reload, a kill -9): replies checked
    against plain decoding, RSS, disk tier, counters and latency sampled.  Exits 1 when an
    expectation does not hold."""
    from ..eval.soak import JUDGED_MINUTES, SoakConfig, failed_lines, markdown, run_soak, unjudged_lines, write_report

    if minutes <= 0 or clients < 1 or max_tokens < 1:
        raise typer.BadParameter("--minutes must be > 0, --clients and --max-tokens >= 1")
    cfg = SoakConfig(minutes=minutes, clients=clients, seed=seed, max_tokens=max_tokens, kill=kill)
    holder = {}

    def run():
        holder["report"] = run_soak(cfg, out, say=lambda s: typer.echo(s, err=True))
        return holder["report"]

    report_of(run, markdown, write_report, out)
    unjudged, failed = unjudged_lines(holder["report"]), failed_lines(holder["report"])
    if unjudged:
        typer.echo("note: not judged in a run this short (its first and last windows held no such reply; "
                   f"run {JUDGED_MINUTES} minutes or more): " + ", ".join(unjudged), err=True)
    if failed:
        typer.echo("!!! expectations that did not hold: " + ", ".join(failed), err=True)
        raise typer.Exit(1)


@bench_app.command("kernels")
def kernels(
    hidden: int = typer.Option(5120, "--hidden", help="Hidden size (default: Qwen3.8-27B's)."),
    blocks: List[int] = typer.Option([5, 8], "--block", help="Block sizes; repeat."),
    top_k: int = typer.Option(16, "--top-k"),
    rank: int = typer.Option(256, "--rank", help="Selector rank."),
    vocab: int = typer.Option(32768, "--vocab", help="Codebook rows."),
    batch: int = typer.Option(1, "--batch"),
    repeats: int = typer.Option(20, "--repeats", help="Timed repeats (median)."),
):
    """The Metal kernels (dynamic conv, path selector) against their pure-MLX twins."""
    from ..eval.kernel_bench import bench_kernels

    bench_kernels(hidden=hidden, blocks=tuple(blocks), top_k=top_k, rank=rank, vocab=vocab,
                  batch=batch, repeats=repeats, echo=typer.echo)
