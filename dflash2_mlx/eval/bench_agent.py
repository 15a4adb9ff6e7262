"""``dflash2-mlx bench agent``: an agent session replayed against the server, turn by turn,
through each wire format, beside plain decoding and ``mlx_lm.server``, in one run.

The session is what an agent tool sends: a system prompt with tool definitions, a task,
then turns that each append the model's last reply with a tool call (``read_file``) and
the tool's result (a file of this package's own source, a few hundred to a few thousand
tokens), so the context grows towards the target's window.  The model's replies are its
own (T=0, ``max_tokens`` each); the tool calls and results are scripted, the same in every
run, so every run reads the same prompts.

Runs, one server at a time so that none slows another:
- DFlash (the server's defaults: adaptive blocks, copies, the prefix cache) through OpenAI
  chat, Anthropic Messages, OpenAI Responses and Ollama's chat, each session opened by a
  line naming its API so that no session reuses another's cached prefix;
- plain decoding on the same server (``dflash_verify_mode: off``) with the prefix cache off:
  its decode speed is the baseline, and its time to first token is each context's cold
  prefill;
- ``mlx_lm.server`` (plain, its own prompt cache) on the same target, through OpenAI chat.
Per turn: time to first token, decode tok/s (tokens after the first over the time after
the first), τ and the cached prompt tokens the reply reports.  ``write_report`` saves
bench-agent.json and bench-agent.md.
"""

import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..machine.identity import describe
from .bench_serve import free_port, server, serving
from .report import fmt, table, write_report as write_files

# httpx comes with the dev extra; it is imported where the clients run.

APIS = ("openai-chat", "anthropic", "responses", "ollama")
SYSTEM = ("You are a coding agent working in the dflash2-mlx repository. Read the files you need "
          "with the tools, then explain what the code does, briefly.")
TASK = "Explain how the speculative decoding cycle works in this package, file by file."
TOOL = {"name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
# The tool results' sizes in tokens (a few hundred to a few thousand), cut from the files.
RESULT_TOKENS = (350, 1200, 300, 1600, 450, 700, 300, 900, 250, 500)


def session_files(tokenizer, sizes=RESULT_TOKENS) -> List[dict]:
    """The scripted tool results: this package's own source files, cut to ``sizes`` tokens."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for p in root.rglob("*.py") if p.stat().st_size > 4000)
    out = []
    for i, n in enumerate(sizes):
        path = files[(7 * i) % len(files)]
        ids = tokenizer.encode(path.read_text())[:n]
        out.append({"path": str(path.relative_to(root.parent)), "content": tokenizer.decode(ids)})
    return out


def _call_id(turn: int) -> str:
    return f"call_{turn}"


def messages_for(api: str, header: str, results: List[dict], replies: List[str]) -> dict:
    """The request body's conversation for ``api``: the system prompt, the task, and per turn
    the last reply with a read_file call and its result."""
    openai_tools = [{"type": "function", "function": TOOL}]
    if api in ("openai-chat", "mlx-lm"):
        msgs = [{"role": "system", "content": f"{header}\n{SYSTEM}"}, {"role": "user", "content": TASK}]
        for t, r in enumerate(results):
            call = {"id": _call_id(t), "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": r["path"]})}}
            msgs.append({"role": "assistant", "content": replies[t - 1] if t else "", "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": _call_id(t), "content": r["content"]})
        return {"messages": msgs, "tools": openai_tools}
    if api == "anthropic":
        msgs = [{"role": "user", "content": TASK}]
        for t, r in enumerate(results):
            blocks = [{"type": "text", "text": replies[t - 1]}] if t and replies[t - 1] else []
            blocks.append({"type": "tool_use", "id": _call_id(t), "name": "read_file", "input": {"path": r["path"]}})
            msgs.append({"role": "assistant", "content": blocks})
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": _call_id(t),
                                                      "content": r["content"]}]})
        tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
        return {"system": f"{header}\n{SYSTEM}", "messages": msgs, "tools": tools}
    if api == "responses":
        items = [{"role": "user", "content": TASK}]
        for t, r in enumerate(results):
            if t and replies[t - 1]:
                items.append({"role": "assistant", "content": replies[t - 1]})
            items.append({"type": "function_call", "call_id": _call_id(t), "name": "read_file",
                          "arguments": json.dumps({"path": r["path"]})})
            items.append({"type": "function_call_output", "call_id": _call_id(t), "output": r["content"]})
        return {"instructions": f"{header}\n{SYSTEM}", "input": items, "tools": [{"type": "function", **TOOL}]}
    if api == "ollama":
        msgs = [{"role": "system", "content": f"{header}\n{SYSTEM}"}, {"role": "user", "content": TASK}]
        for t, r in enumerate(results):
            call = {"function": {"name": "read_file", "arguments": {"path": r["path"]}}}
            msgs.append({"role": "assistant", "content": replies[t - 1] if t else "", "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_name": "read_file", "content": r["content"]})
        return {"messages": msgs, "tools": openai_tools}
    raise ValueError(f"unknown API {api!r}; one of {APIS + ('mlx-lm',)}")


def request_for(api: str, model: str, conversation: dict, max_tokens: int) -> tuple:
    """(path, body) of one streamed T=0 request."""
    if api in ("openai-chat", "mlx-lm"):
        return "/v1/chat/completions", {"model": model, **conversation, "max_tokens": max_tokens, "temperature": 0.0,
                                        "stream": True, "stream_options": {"include_usage": True}}
    if api == "anthropic":
        return "/v1/messages", {"model": model, **conversation, "max_tokens": max_tokens, "temperature": 0.0,
                                "stream": True}
    if api == "responses":
        return "/v1/responses", {"model": model, **conversation, "max_output_tokens": max_tokens,
                                 "temperature": 0.0, "stream": True, "store": False}
    return "/api/chat", {"model": model, **conversation, "stream": True,
                         "options": {"temperature": 0.0, "num_predict": max_tokens}}


def _events(api: str, lines):
    """The JSON events of a streamed reply (SSE ``data:`` lines, or Ollama's NDJSON)."""
    for line in lines:
        if api == "ollama":
            if line.strip():
                yield json.loads(line)
        elif line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _text_of(api: str, event: dict) -> str:
    if api in ("openai-chat", "mlx-lm"):
        return "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or [])
    if api == "anthropic":
        delta = event.get("delta") or {}
        return delta.get("text", "") if event.get("type") == "content_block_delta" else ""
    if api == "responses":
        return event.get("delta", "") if event.get("type") == "response.output_text.delta" else ""
    return (event.get("message") or {}).get("content", "") if not event.get("done") else ""


def _find(event, key: str):
    """The first value under ``key`` anywhere in ``event``."""
    if isinstance(event, dict):
        if key in event:
            return event[key]
        event = list(event.values())
    if isinstance(event, list):
        for v in event:
            found = _find(v, key)
            if found is not None:
                return found
    return None


def _tokens_of(api: str, event: dict) -> Optional[int]:
    for key in ("completion_tokens", "output_tokens", "eval_count"):
        n = _find(event, key)
        if isinstance(n, int):
            return n
    return None


def one_turn(http, api: str, model: str, conversation: dict, max_tokens: int) -> dict:
    """One streamed request: its reply, time to first token, decode speed, τ, cached tokens."""
    path, body = request_for(api, model, conversation, max_tokens)
    sent = time.perf_counter()
    first = None
    text, pieces, tokens, dflash, cached = [], 0, None, {}, 0
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            error = r.read().decode()
            if r.status_code == 400 and "tools" in conversation and "does not render tools" in error:
                # The model's template has no tools section (SmolLM2's): the server refuses the
                # definitions it would drop; the session's calls and results stay in the messages.
                bare = {k: v for k, v in conversation.items() if k != "tools"}
                return {**one_turn(http, api, model, bare, max_tokens), "tools_sent": False}
            raise RuntimeError(f"{api}: HTTP {r.status_code}: {error[:300]}")
        for event in _events(api, r.iter_lines()):
            if event.get("type") == "error" or (api != "anthropic" and "error" in event):
                raise RuntimeError(f"{api}: stream error: {event}")
            piece = _text_of(api, event)
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
                pieces += 1
            tokens = _tokens_of(api, event) or tokens
            dflash = _find(event, "dflash") or dflash
            cached = _find(event, "cached_tokens") or _find(event, "cache_read_input_tokens") or cached
    end = time.perf_counter()
    first = first or end
    n = tokens or pieces
    return {"text": "".join(text), "ttft_s": first - sent, "total_s": end - sent, "tokens": n,
            "decode_tps": (n - 1) / (end - first) if n > 1 and end > first else 0.0,
            "tau": dflash.get("tau", 0.0) if isinstance(dflash, dict) else 0.0, "cached_tokens": cached}


def run_session(base: str, api: str, model: str, results: List[dict], max_tokens: int,
                log: Callable[[str], None] = print, label: Optional[str] = None) -> List[dict]:
    """The whole session through ``api``: one record per turn."""
    import httpx

    # Named by its API only (mlx_lm.server's as OpenAI chat's): the plain and mlx-lm runs read
    # the DFlash OpenAI-chat session's very prompts, while no two APIs share a cached prefix.
    header = f"Session: {'openai-chat' if api == 'mlx-lm' else api}."
    replies, turns = [], []
    with httpx.Client(base_url=base, timeout=3600) as http:
        for t in range(len(results)):
            rec = one_turn(http, api, model, messages_for(api, header, results[: t + 1], replies), max_tokens)
            replies.append(rec["text"])
            turns.append({"turn": t + 1, **rec})
            log(f"  {label or api:<14} turn {t + 1:>2}: ttft {rec['ttft_s']:.2f} s, {rec['decode_tps']:.1f} tok/s, "
                f"tau {rec['tau']:.2f}, cached {rec['cached_tokens']}")
    return turns


@contextmanager
def mlx_lm_server(target: str, log_path: Path, timeout: float = 600.0):
    """``mlx_lm.server`` on a free loopback port: its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "mlx_lm.server", "--model", target, "--host", "127.0.0.1", "--port", str(port)]
    with serving(command, port, log_path, "mlx_lm.server", timeout) as base:
        yield base

def run_agent_bench(*, model: Optional[str] = None, draft: Optional[str] = None, apis=APIS, max_tokens: int = 48,
                    sizes=RESULT_TOKENS, mlx_lm: bool = True, work_dir: Optional[Path] = None,
                    log: Callable[[str], None] = print) -> dict:
    """The whole benchmark (see the module docstring); the report as a dict."""
    from mlx_lm.utils import load_tokenizer

    from ..builtin.smollm2 import default_target_path

    target = str(model or default_target_path())
    model_id = Path(target).name
    results = session_files(load_tokenizer(Path(target)), sizes)
    work = Path(work_dir or tempfile.mkdtemp(prefix="bench-agent-"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--log-level", "warning", "--max-tokens", str(max_tokens), "--max-batch", "1"]
    if model:
        common += ["--model", f"{model_id}={model}"] + (["--draft", draft] if draft else [])
    runs: Dict[str, List[dict]] = {}
    warm = [{"path": "warm-up", "content": "def f():\n    return 1\n"}]

    def settings(entry: dict) -> List[str]:
        path = work / f"settings-{len(list(work.glob('settings-*')))}.json"
        path.write_text(json.dumps({"version": 1, "models": {model_id: entry}}))
        return ["--settings", str(path)]

    log(f"bench agent: {model_id}, {len(results)} turns of {max_tokens} tokens, tool results {list(sizes)} tokens")
    with server(common + settings({}), work / "server-dflash.log") as base:
        for api in apis:
            run_session(base, api, model_id, warm, max_tokens, log, label=f"warm-up {api}")
            runs[f"dflash {api}"] = run_session(base, api, model_id, results, max_tokens, log, label=f"dflash {api}")
    with server(common + settings({"dflash_verify_mode": "off"}) + ["--prefix-cache-gb", "0"],
                work / "server-plain.log") as base:
        run_session(base, "openai-chat", model_id, warm, max_tokens, log, label="warm-up plain")
        runs["plain, cold"] = run_session(base, "openai-chat", model_id, results, max_tokens, log, label="plain, cold")
    if mlx_lm:
        with mlx_lm_server(target, work / "mlx-lm-server.log") as base:
            run_session(base, "mlx-lm", target, warm, max_tokens, log, label="warm-up mlx-lm")
            runs["mlx_lm.server"] = run_session(base, "mlx-lm", target, results, max_tokens, log, label="mlx_lm.server")
    return {"config": {"model": target, "draft": draft, "apis": list(apis), "max_tokens": max_tokens,
                       "tool_result_tokens": list(sizes), "turns": len(results)},
            "machine": describe(), "runs": runs, "goals": goals(runs)}


def goals(runs: Dict[str, List[dict]]) -> dict:
    """The issue's three goals, per DFlash run: time to first token from turn 2 at most 0.2x
    the cold prefill of the same context; decode at least 0.95x plain at every turn; the
    session faster end to end than mlx_lm.server.  And T=0 parity with plain decoding."""
    cold, theirs = runs.get("plain, cold"), runs.get("mlx_lm.server")
    out = {}
    for name, turns in runs.items():
        if not name.startswith("dflash") or cold is None:
            continue
        ttft = [t["ttft_s"] / c["ttft_s"] for t, c in zip(turns[1:], cold[1:]) if c["ttft_s"] > 0]
        decode = [t["decode_tps"] / c["decode_tps"] for t, c in zip(turns, cold) if c["decode_tps"] > 0]
        total = sum(t["total_s"] for t in turns)
        row = {"worst_ttft_vs_cold": max(ttft, default=None), "worst_decode_vs_plain": min(decode, default=None),
               "mean_decode_vs_plain": sum(decode) / len(decode) if decode else None, "session_s": total,
               "same_text_as_plain": sum(t["text"] == c["text"] for t, c in zip(turns, cold))}
        if theirs is not None:
            row["session_vs_mlx_lm"] = sum(t["total_s"] for t in theirs) / total if total else None
        out[name] = row
    return out


def markdown(report: dict) -> str:
    cfg, runs = report["config"], report["runs"]
    lines = [f"# bench agent: {Path(cfg['model']).name}", "",
             f"{cfg['turns']} turns, tool results of {cfg['tool_result_tokens']} tokens, {cfg['max_tokens']} tokens "
             f"per reply at T=0. Machine: {report['machine'].get('platform')}, "
             f"{report['machine'].get('cpus', '?')} cores.", "",
             "## Goals", ""]
    rows = [[name, fmt(g["worst_ttft_vs_cold"]), fmt(g["worst_decode_vs_plain"]), fmt(g["mean_decode_vs_plain"]),
             fmt(g["session_s"], ".1f"), fmt(g.get("session_vs_mlx_lm")), f"{g['same_text_as_plain']}/{cfg['turns']}"]
            for name, g in report["goals"].items()]
    lines += table(["run", "worst TTFT / cold (turn 2+)", "worst decode / plain", "mean decode / plain",
                    "session s", "mlx_lm.server s / ours", "replies = plain"], rows)
    lines += ["", "## Per turn", ""]
    names = list(runs)
    header = ["turn"] + [f"{n} TTFT s" for n in names] + [f"{n} tok/s" for n in names] + ["dflash tau"]
    first = next((n for n in names if n.startswith("dflash")), None)
    rows = []
    for i in range(cfg["turns"]):
        row = [i + 1] + [fmt(runs[n][i]["ttft_s"]) for n in names] + [fmt(runs[n][i]["decode_tps"], ".1f") for n in names]
        rows.append(row + [fmt(runs[first][i]["tau"]) if first else "-"])
    lines += table(header, rows)
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir) -> List[Path]:
    return write_files(out_dir, "bench-agent", report, markdown(report))
