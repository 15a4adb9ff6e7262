"""``dflash2-mlx bench soak``: the server under an agent setup's mixed traffic for a long
while, with faults, checked as it goes.

One ``dflash2-mlx serve`` process on loopback serves the built-in pair three ways (its own
home, settings file and disk tier): ``soak`` (DFlash, block size chosen every cycle, prefix
cache with a small memory tier so entries spill to disk), ``soak-b4`` (DFlash at block 4:
seeded sampling repeats only at a fixed block size) and ``plain`` (plain decoding: the
references).  Before the run, every greedy input's reply is fetched from ``plain`` through
the same API.  Then ``clients`` threads send a seeded mix for ``minutes``:

- greedy requests through the real openai, anthropic and ollama clients and raw HTTP
  (chat, completions, Responses, Messages, Ollama chat and generate), each reply compared
  with plain decoding's: equal, or (where the exactness probe found verify rows not
  row-exact here) differing first where plain decoding's top two tokens are closer than the
  probe's largest logit difference, reported with that margin;
- multi-turn chats that grow (prefix-cache hits), long prompts (4-7k tokens), short ones;
- seeded sampled requests on ``soak-b4``, checked to repeat;
- faults: hang-ups mid-prompt and mid-stream, malformed requests (each must be a 4xx in its
  API's shape), oversize prompts, a settings change that needs a reload (applied while
  ``soak-b4`` is left idle, checked on its next reply), one ``kill -9`` and restart (in-flight
  clients must get an error, not a hang; the disk tier must serve hits afterwards).

Sampled every few seconds: the server's RSS, the disk tier's size, ``/metrics``; per
request: time to first token and the gaps between streamed tokens.  ``write_report`` writes
soak.json, soak.md and soak.png (RSS and p95 latency over time).
"""

import json
import os
import random
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..builtin.bench_sets import default_bench_files
from ..calibration import store
from ..machine.identity import describe
from .bench_serve import free_port, serve_command
from .prompts import sample_prompts
from .report import write_report as write_files

# The clients (httpx, openai, anthropic, ollama) come with the dev extra, not the package:
# imported where the traffic is sent.

APIS = ("openai-chat", "openai-completions", "responses", "anthropic", "ollama-chat", "ollama-generate")
# Any one request: the openai and anthropic clients' own default.  A hang fails it (and the
# soak's "no hang" line); an uncached long prompt read beside a busy batch takes minutes here.
TIMEOUT_S = 600.0


@dataclass
class SoakConfig:
    minutes: float = 60.0
    clients: int = 6
    seed: int = 0
    max_tokens: int = 40
    short_inputs: int = 24  # distinct short greedy inputs (each sent many times)
    long_inputs: int = 2  # distinct long prompts
    long_tokens: tuple = (4000, 7000)  # their size range
    chats: int = 3  # multi-turn chats (scripts of turns)
    turns: int = 3
    sampled_inputs: int = 4
    kill: bool = True  # one kill -9 and restart, at KILL_AT of the run
    reload: bool = True  # one settings change that needs a reload, at RELOAD_AT
    sample_s: float = 5.0
    prefix_cache_gb: float = 0.02  # small: entries spill to the disk tier
    ssd_cache_bytes: int = 2**30  # a 7k-token prompt's cache is about 320 MB
    window: int = 8192  # max_context_window; an oversize prompt is longer
    prompt_chars: int = 0  # cut every short prompt and chat turn to this many characters (0: whole)


RELOAD_AT, KILL_AT = 0.35, 0.6
WARM_UP = 0.1  # share of each server lifetime left out of the RSS growth
FLOOR = 0.1  # the RSS percentile a window is judged by: what the server comes back to
JUDGED_MINUTES = 10  # a shorter run's first and last windows may hold no reply: not judged
HOLDS = {True: "yes", False: "**no**", None: "not judged (no reply in a window of this short run)"}


@dataclass
class Log:
    """What the run saw, appended to by every client thread (under ``lock``)."""
    started: float = field(default_factory=time.time)
    requests: List[dict] = field(default_factory=list)
    samples: List[dict] = field(default_factory=list)
    events: List[dict] = field(default_factory=list)
    long: List[dict] = field(default_factory=list)  # each long prompt's time in the server: sent, t
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, table: str, **row):
        with self.lock:
            getattr(self, table).append({"t": time.time() - self.started, **row})


# Inputs ----------------------------------------------------------------------------------


def inputs(cfg: SoakConfig) -> dict:
    """The seeded inputs: short greedy ones (each with its API), long prompts, chat scripts,
    sampled ones."""
    rng = random.Random(cfg.seed)
    need = cfg.short_inputs + cfg.chats * cfg.turns + cfg.sampled_inputs
    files = default_bench_files()
    drawn = sample_prompts(files, -(-need // len(files)), seed=cfg.seed)
    texts = [_text(p) for i in range(max(map(len, drawn.values()))) for ps in drawn.values() if i < len(ps)
             for p in [ps[i]]][:need]
    texts = [t[:cfg.prompt_chars] if cfg.prompt_chars else t for t in texts]
    short = [{"api": APIS[i % len(APIS)], "text": t} for i, t in enumerate(texts[:cfg.short_inputs])]
    rest = texts[cfg.short_inputs:]
    chats = [rest[i * cfg.turns:(i + 1) * cfg.turns] for i in range(cfg.chats)]
    sampled = rest[cfg.chats * cfg.turns:]
    pool = " ".join(texts)
    long = []
    for i in range(cfg.long_inputs):
        words = rng.randint(*cfg.long_tokens) * 10 // 17  # these sets' text: about 1.7 tokens a word
        body = " ".join((pool.split() * (1 + words // max(1, len(pool.split()))))[i * 7:i * 7 + words])
        long.append({"api": "openai-chat", "text": body + "\n\nSummarize the text above in one sentence."})
    return {"short": short, "long": long, "chats": chats, "sampled": sampled}


def _text(prompt) -> str:
    """A prompt set's record as one user turn (a chat record: its last user message)."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt)


# The server --------------------------------------------------------------------------------


class Server:
    """``dflash2-mlx serve`` on a fixed loopback port, killed and restarted on demand."""

    def __init__(self, work: Path, cfg: SoakConfig, home: Path):
        from ..builtin.defaults import default_pair

        target, drafter = default_pair()
        self.work, self.cfg, self.port = work, cfg, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        models = work / "models"
        models.mkdir(parents=True, exist_ok=True)
        for name in ("soak", "soak-b4", "plain"):
            if not (models / name).exists():
                (models / name).symlink_to(Path(target).resolve(), target_is_directory=True)
        self.ssd = work / "ssd"
        self.settings = work / "model_settings.json"
        dflash = {"dflash_enabled": True, "dflash_draft_model": str(drafter), "max_context_window": cfg.window,
                  "is_pinned": True}
        self.write_settings({
            "soak": {**dflash, "dflash_ssd_cache": True, "dflash_ssd_cache_max_bytes": cfg.ssd_cache_bytes},
            "soak-b4": {**dflash, "dflash_block_size": 4},
            "plain": {"dflash_enabled": False, "max_context_window": cfg.window, "is_pinned": True}})
        self.env = {**os.environ, "DFLASH2_MLX_HOME": str(home)}
        self.home, self.proc, self.starts = home, None, []

    def write_settings(self, models: dict):
        tmp = self.settings.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": 1, "models": models}, indent=1))
        os.replace(tmp, self.settings)

    def edit(self, model: str, **changes):
        data = json.loads(self.settings.read_text())
        data["models"][model].update(changes)
        self.write_settings(data["models"])

    def start(self) -> float:
        """Start it and wait for /health: the seconds that took."""
        import httpx

        tic = time.time()
        log = open(self.work / "server.log", "a")
        self.proc = subprocess.Popen(serve_command() + [
            "serve", "--port", str(self.port), "--model-dir", str(self.work / "models"), "--settings",
            str(self.settings), "--max-models", "3", "--max-batch", "4", "--queue-size", "16",
            "--prefix-cache-gb", str(self.cfg.prefix_cache_gb), "--ssd-cache-dir", str(self.ssd),
            "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {(self.work / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() - tic > 300:
                raise RuntimeError("the server did not start in 300 s")
            time.sleep(0.1)
        self.starts.append(time.time() - tic)
        return self.starts[-1]

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def rss(self) -> Optional[int]:
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss
        except (psutil.Error, AttributeError):
            return None

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.ssd.rglob("*") if f.is_file()) if self.ssd.exists() else 0

    def metrics(self) -> Optional[dict]:
        import httpx

        try:
            return httpx.get(self.base + "/metrics", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return None

    def probe_margin(self) -> Optional[float]:
        """The largest logit difference the exactness probe found here (None: rows exact, or
        not probed)."""
        found = []
        for f in (self.home / "calibration").glob("exactness-*.json"):
            data = store.data_of(f) or {}
            if not data.get("exact", True):
                found.append(float(data.get("max_abs_diff", 0.0)))
        return max(found) if found else None


# Requests ----------------------------------------------------------------------------------


class Clients:
    """One request of each API, through its real client library or raw HTTP; each returns
    (text, time to first token, gaps between streamed pieces)."""

    def __init__(self, base: str):
        import anthropic
        import httpx
        import ollama
        import openai

        self.base = base
        self.openai = openai.OpenAI(base_url=base + "/v1", api_key="soak", max_retries=0, timeout=TIMEOUT_S)
        self.anthropic = anthropic.Anthropic(base_url=base, api_key="soak", max_retries=0, timeout=TIMEOUT_S)
        self.ollama = ollama.Client(host=base, timeout=TIMEOUT_S)
        self.http = httpx.Client(base_url=base, timeout=TIMEOUT_S)
        self.last: dict = {}

    def send(self, api: str, model: str, messages: List[dict], max_tokens: int, temp: float = 0.0,
             seed: Optional[int] = None, stream: bool = False) -> dict:
        self.last = {"api": api, "model": model, "stream": stream}  # for a failure's line of the report
        tic, first, gaps, pieces = time.perf_counter(), None, [], []

        def piece(text):
            nonlocal first
            now = time.perf_counter()
            if text:
                if first is not None:
                    gaps.append(now - piece.last)
                first = first if first is not None else now - tic
                piece.last = now
                pieces.append(text)
        piece.last = tic
        prompt = messages[-1]["content"]
        if api == "openai-chat":
            kw = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=temp, seed=seed)
            if stream:
                for c in self.openai.chat.completions.create(**kw, stream=True):
                    piece(c.choices[0].delta.content if c.choices else None)
            else:
                piece(self.openai.chat.completions.create(**kw).choices[0].message.content)
        elif api == "openai-completions":
            kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temp, seed=seed)
            if stream:
                for c in self.openai.completions.create(**kw, stream=True):
                    piece(c.choices[0].text if c.choices else None)
            else:
                piece(self.openai.completions.create(**kw).choices[0].text)
        elif api == "responses":
            r = self.openai.responses.create(model=model, input=messages, max_output_tokens=max_tokens,
                                             temperature=temp)
            piece(r.output_text)
        elif api == "anthropic":
            # This SDK has no temperature argument; the API takes it (default 1).
            kw = dict(model=model, messages=messages, max_tokens=max_tokens, extra_body={"temperature": temp})
            if stream:
                with self.anthropic.messages.stream(**kw) as s:
                    for text in s.text_stream:
                        piece(text)
            else:
                piece("".join(b.text for b in self.anthropic.messages.create(**kw).content if b.type == "text"))
        elif api == "ollama-chat":
            options = {"temperature": temp, "num_predict": max_tokens, **({"seed": seed} if seed is not None else {})}
            if stream:
                for c in self.ollama.chat(model=model, messages=messages, options=options, stream=True):
                    piece(c["message"]["content"])
            else:
                piece(self.ollama.chat(model=model, messages=messages, options=options)["message"]["content"])
        elif api == "ollama-generate":
            options = {"temperature": temp, "num_predict": max_tokens, **({"seed": seed} if seed is not None else {})}
            piece(self.ollama.generate(model=model, prompt=prompt, options=options)["response"])
        elif api == "raw-chat":  # raw HTTP, streamed server-sent events
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temp,
                    "stream": True, **({"seed": seed} if seed is not None else {})}
            with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if "error" in event:
                            raise RuntimeError(f"stream error: {event['error']}")
                        for choice in event.get("choices") or []:
                            piece((choice.get("delta") or {}).get("content"))
        else:
            raise ValueError(f"unknown api {api}")
        return {"text": "".join(pieces), "ttft": first, "gaps": gaps, "seconds": time.perf_counter() - tic}

    def margin(self, api: str, messages: List[dict], common: int, max_tokens: int) -> Optional[float]:
        """Plain decoding's top-two logprob gap at the token where a reply first differs (the
        token whose text crosses ``common`` characters); None where the API has no such
        request (Responses, Anthropic and Ollama chats are rendered as OpenAI chats)."""
        if api in ("openai-completions", "ollama-generate"):
            r = self.openai.completions.create(model="plain", prompt=messages[-1]["content"], max_tokens=max_tokens,
                                               temperature=0, logprobs=2)
            rows = [(t, sorted(top.values(), reverse=True)) for t, top in
                    zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.top_logprobs)]
        else:
            r = self.openai.chat.completions.create(model="plain", messages=messages, max_tokens=max_tokens,
                                                    temperature=0, logprobs=True, top_logprobs=2)
            rows = [(c.token, [t.logprob for t in c.top_logprobs]) for c in r.choices[0].logprobs.content]
        seen = 0
        for token, top in rows:
            seen += len(token)
            if seen > common:
                return top[0] - top[1] if len(top) > 1 else None
        return None

    def hang_up(self, model: str, text: str, after_chunks: int):
        """A streamed chat the client leaves: after ``after_chunks`` events (0: before the
        first, while the prompt is read)."""
        import httpx

        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 200, "stream": True}
        try:
            with httpx.stream("POST", self.base + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(TIMEOUT_S, read=0.3 if after_chunks == 0 else TIMEOUT_S)) as r:
                for n, _ in enumerate(r.iter_lines() if after_chunks else ()):
                    if n + 1 >= after_chunks:
                        break
        except httpx.ReadTimeout:  # no headers within 0.3 s: left while the prompt is read
            pass

    def close(self):
        self.http.close()


# Bad requests: (path, body, the API whose error shape it gets).  Each must be a 4xx.
BAD = [
    ("/v1/chat/completions", {"model": "soak", "messages": "hi"}, "openai"),
    ("/v1/chat/completions", {"model": "soak", "messages": [{"role": "user", "content": "x"}], "temperature": -1},
     "openai"),
    ("/v1/chat/completions", {"model": "soak", "messages": [{"role": "user"}]}, "openai"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "openai"),
    ("/v1/completions", {"model": "soak", "prompt": "x", "max_tokens": -5}, "openai"),
    ("/v1/completions", {"model": "soak", "prompt": "x", "seed": -1}, "openai"),
    ("/v1/responses", {"model": "soak", "input": 5}, "openai"),
    ("/v1/messages", {"model": "soak", "messages": [{"role": "user", "content": "x"}]}, "anthropic"),
    ("/v1/messages", {"model": "soak", "max_tokens": 8, "temperature": 1.5,
                      "messages": [{"role": "user", "content": "x"}]}, "anthropic"),
    ("/api/chat", {"model": "soak", "messages": [{"role": "user"}]}, "ollama"),
    ("/api/generate", {"model": "soak", "prompt": "x", "options": {"top_p": 2.0}}, "ollama"),
    ("/v1/chat/completions", "{not json", "openai"),
]


def shaped(api: str, status: int, body) -> bool:
    """Whether an error reply is a 4xx in ``api``'s own shape."""
    if not 400 <= status < 500 or not isinstance(body, dict):
        return False
    if api == "openai":
        return isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str)
    if api == "anthropic":
        return body.get("type") == "error" and isinstance((body.get("error") or {}).get("message"), str)
    return isinstance(body.get("error"), str)


# The run -----------------------------------------------------------------------------------


class Soak:
    def __init__(self, cfg: SoakConfig, work: Path, home: Optional[Path] = None,
                 say: Callable[[str], None] = print):
        self.cfg, self.work, self.say = cfg, Path(work), say
        self.work.mkdir(parents=True, exist_ok=True)
        self.server = Server(self.work, cfg, Path(home) if home else self.work / "home")
        self.inputs = inputs(cfg)
        self.log = Log()
        self.refs: Dict[str, str] = {}  # greedy input key -> plain decoding's reply
        self.chat_refs: List[List[str]] = []  # per chat script: plain decoding's replies, turn by turn
        self.seeded: Dict[str, str] = {}  # (input, seed, block) -> the first reply
        self.block = 4  # soak-b4's block size (5 after the reload)
        self.paused = threading.Event()  # soak-b4 left idle for the reload
        self.down = threading.Event()  # the server is being killed and restarted
        self.stop_at = 0.0
        self.boot_s = self.references_first_s = None  # start to a first answer, at the run's start

    # -- references, before the run
    def references(self):
        c = Clients(self.server.base)
        try:
            for item in self.inputs["short"] + self.inputs["long"]:
                tic = time.time()
                self.refs[self.key(item)] = c.send(item["api"], "plain", self.messages(item["text"]),
                                                   self.cfg.max_tokens)["text"]
                if self.references_first_s is None:  # the model's load and one reply
                    self.references_first_s = time.time() - tic
            for script in self.inputs["chats"]:
                messages, replies = [], []
                for turn in script:
                    messages = messages + [{"role": "user", "content": turn}]
                    reply = c.send("openai-chat", "plain", messages, self.cfg.max_tokens)["text"]
                    replies.append(reply)
                    messages = messages + [{"role": "assistant", "content": reply}]
                self.chat_refs.append(replies)
        finally:
            c.close()

    def warm_up(self):
        """The first long prompt on ``soak`` before the clock starts: a first use measures the
        pair's costs, and the prompt's cache is then on the disk tier for the restart to find."""
        c = Clients(self.server.base)
        try:
            c.send("openai-chat", "soak", self.messages(self.inputs["long"][0]["text"]), 4)
            c.send("openai-chat", "soak-b4", self.messages("hi"), 4)  # loaded before RSS counts
        finally:
            c.close()

    @staticmethod
    def key(item: dict) -> str:
        return f"{item['api']}:{item['text']}"

    @staticmethod
    def messages(text: str) -> List[dict]:
        return [{"role": "user", "content": text}]

    # -- one client's loop
    def client(self, i: int):
        rng = random.Random(self.cfg.seed * 1000 + i)
        c = Clients(self.server.base)
        chat = None  # (script index, turn, messages) of the chat this client is in
        try:
            while time.time() < self.stop_at:
                if self.down.is_set():
                    time.sleep(0.2)
                    continue
                roll = rng.random()
                what, c.last = None, {}
                try:
                    if chat is not None or roll < 0.15:
                        what = "chat"
                        chat = self.chat_turn(c, rng, chat)
                    elif roll < 0.55:
                        what = "short"
                        self.greedy(c, rng.choice(self.inputs["short"]), stream=rng.random() < 0.5)
                    elif roll < 0.6:
                        what = "long"
                        self.greedy(c, rng.choice(self.inputs["long"]), stream=True)
                    elif roll < 0.75:
                        what = "sampled"
                        self.sampled(c, rng)
                    elif roll < 0.83:
                        what = "hang-up"
                        self.hang_up(c, rng)
                    elif roll < 0.95:
                        what = "bad"
                        self.bad(c, rng)
                    else:
                        what = "oversize"
                        self.oversize(c)
                except Exception as e:  # noqa: BLE001 - every failure is a line of the report
                    self.log.add("requests", kind="error", of=what, **c.last,
                                 error=f"{type(e).__name__}: {str(e)[:200]}", during_kill=self.down.is_set())
                    chat = None
        finally:
            c.close()

    def greedy(self, c: Clients, item: dict, stream: bool):
        api = "raw-chat" if item["api"] == "openai-chat" and stream and item in self.inputs["short"] else item["api"]
        streamable = api in ("openai-chat", "openai-completions", "anthropic", "ollama-chat")
        long = item in self.inputs["long"]
        with self.in_flight(long):
            r = c.send(api, "soak", self.messages(item["text"]), self.cfg.max_tokens, stream=stream and streamable)
        self.check(c, "long" if long else "short", item["api"], self.messages(item["text"]),
                   self.refs[self.key(item)], r)

    @contextmanager
    def in_flight(self, long: bool):
        """Logs a long prompt's time in the server, answered or not: a reply decoded beside
        one takes its cycles at the long context's cost (the gap line compares like with like)."""
        sent = time.time() - self.log.started
        try:
            yield
        finally:
            if long:
                self.log.add("long", sent=sent)

    def check(self, c: Clients, kind: str, api: str, messages, ref: str, r: dict):
        same = r["text"] == ref
        row = {"kind": kind, "api": api, "same": same, "ttft": r["ttft"], "seconds": r["seconds"],
               "gaps": r["gaps"], "during_kill": self.down.is_set()}
        if not same:
            common = next((k for k, (a, b) in enumerate(zip(r["text"], ref)) if a != b), min(len(r["text"]), len(ref)))
            row.update(margin=c.margin(api, messages, common, self.cfg.max_tokens), got=r["text"][:200],
                       plain=ref[:200])
        self.log.add("requests", **row)
        return same

    def chat_turn(self, c: Clients, rng: random.Random, chat):
        """One turn of a growing chat; ``chat``: (script, turn, messages so far, whether every
        earlier reply was plain decoding's, so that this turn's input is the reference's)."""
        if chat is None:
            chat = (rng.randrange(len(self.inputs["chats"])), 0, [], True)
        s, turn, messages, on_track = chat
        messages = messages + [{"role": "user", "content": self.inputs["chats"][s][turn]}]
        api = rng.choice(("openai-chat", "anthropic", "ollama-chat"))
        r = c.send(api, "soak", messages, self.cfg.max_tokens, stream=rng.random() < 0.5)
        if on_track:
            on_track = self.check(c, "chat", api, messages, self.chat_refs[s][turn], r)
        else:
            self.log.add("requests", kind="chat-unchecked", api=api, during_kill=self.down.is_set())
        messages = messages + [{"role": "assistant", "content": r["text"]}]
        return None if turn + 1 >= len(self.inputs["chats"][s]) else (s, turn + 1, messages, on_track)

    def sampled(self, c: Clients, rng: random.Random):
        if self.paused.is_set():
            return
        text = rng.choice(self.inputs["sampled"])
        seed = rng.randrange(3)
        api = rng.choice(("openai-chat", "ollama-chat"))
        block = self.block
        r = c.send(api, "soak-b4", self.messages(text), self.cfg.max_tokens, temp=0.8, seed=seed)
        key = f"{api}:{seed}:{block}:{text}"
        with self.log.lock:
            first = self.seeded.setdefault(key, r["text"])
        self.log.add("requests", kind="sampled", api=api, same=first == r["text"], block=block, ttft=r["ttft"],
                     seconds=r["seconds"], gaps=[], during_kill=self.down.is_set())

    def hang_up(self, c: Clients, rng: random.Random):
        long = rng.random() < 0.5
        text = rng.choice(self.inputs["long"] if long else self.inputs["short"])["text"]
        after = 0 if long else rng.choice((2, 5))
        with self.in_flight(long):
            c.hang_up("soak", text, after)
        self.log.add("requests", kind="hang-up", mid="prompt" if after == 0 else "stream", during_kill=self.down.is_set())

    def bad(self, c: Clients, rng: random.Random):
        path, body, api = rng.choice(BAD)
        content = body if isinstance(body, str) else json.dumps(body)
        r = c.http.post(path, content=content, headers={"content-type": "application/json"})
        try:
            reply = r.json()
        except ValueError:
            reply = None
        self.log.add("requests", kind="bad", path=path, sent=content[:120], status=r.status_code,
                     shaped=shaped(api, r.status_code, reply), reply=r.text[:200], during_kill=self.down.is_set())

    def oversize(self, c: Clients):
        text = " ".join(["word"] * (self.cfg.window + 500))
        r = c.http.post("/v1/chat/completions", json={"model": "soak", "messages": self.messages(text), "max_tokens": 8})
        try:
            reply = r.json()
        except ValueError:
            reply = None
        self.log.add("requests", kind="oversize", status=r.status_code, shaped=shaped("openai", r.status_code, reply),
                     reply=r.text[:200], during_kill=self.down.is_set())

    # -- the controller: samples, the reload, the kill
    def sampler(self):
        while time.time() < self.stop_at:
            # While the server is down (killed, restarting) its RSS is a dying or loading process's.
            down = self.down.is_set()
            m = None if down else self.server.metrics()
            self.log.add("samples", rss=None if down else self.server.rss(), disk=self.server.disk_bytes(), metrics=m,
                         lifetime=len(self.server.starts))
            time.sleep(self.cfg.sample_s)

    def reload(self):
        """Change soak-b4's block size (a reload) while its traffic pauses; then check that its
        next reply runs at the new size."""
        import httpx

        self.paused.set()
        self.block = 5
        self.server.edit("soak-b4", dflash_block_size=5)
        deadline, applied = time.time() + 60, False
        while time.time() < deadline and not applied:
            time.sleep(1.0)
            r = httpx.post(self.server.base + "/v1/chat/completions", timeout=TIMEOUT_S,
                           json={"model": "soak-b4", "messages": self.messages("hi"), "max_tokens": 4})
            applied = r.headers.get("x-dflash-block-size") == "5"
        self.paused.clear()
        self.log.add("events", event="reload", applied=applied)

    def kill(self):
        """``kill -9`` with requests in flight; restart; time the first answered request, then
        a request whose prefix the disk tier kept."""
        import httpx

        self.down.set()
        before = self.server.metrics() or {}
        self.server.kill()
        killed = time.time()
        start_s = self.server.start()
        r = httpx.post(self.server.base + "/v1/chat/completions", timeout=TIMEOUT_S,
                       json={"model": "soak", "messages": self.messages("hello"), "max_tokens": 8})
        first_s = time.time() - killed
        for model in ("soak-b4", "plain"):  # loaded again before this lifetime's RSS counts
            httpx.post(self.server.base + "/v1/chat/completions", timeout=TIMEOUT_S,
                       json={"model": model, "messages": self.messages("hi"), "max_tokens": 4})
        self.down.clear()
        long = self.inputs["long"][0]
        httpx.post(self.server.base + "/v1/chat/completions", timeout=TIMEOUT_S,
                   json={"model": "soak", "messages": self.messages(long["text"]), "max_tokens": 4})
        hits = ((self.server.metrics() or {}).get("models", {}).get("soak", {}) or {}).get("prefix_cache_ssd_hits", 0)
        self.log.add("events", event="kill", restart_s=start_s, first_answer_s=first_s, first_status=r.status_code,
                     ssd_hits_after=hits, metrics_before=before)

    def run(self) -> dict:
        cfg, server = self.cfg, self.server
        self.say(f"soak: starting the server (models soak, soak-b4, plain; log {self.work / 'server.log'})")
        try:
            boot = server.start()
            tic = time.time()
            self.references()
            self.boot_s = boot + self.references_first_s  # to /health, then a model's load and one reply
            self.warm_up()
            self.say(f"soak: {len(self.refs)} greedy references and {len(self.chat_refs)} chats from plain "
                     f"decoding, and the DFlash models warmed up, in {time.time() - tic:.0f} s; {cfg.clients} "
                     f"clients for {cfg.minutes:g} min")
            self.log = Log()
            self.stop_at = time.time() + cfg.minutes * 60
            threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(cfg.clients)]
            threads.append(threading.Thread(target=self.sampler, daemon=True))
            for t in threads:
                t.start()
            span = cfg.minutes * 60
            for at, event, on in ((RELOAD_AT, self.reload, cfg.reload), (KILL_AT, self.kill, cfg.kill)):
                if on:
                    time.sleep(max(0.0, self.log.started + at * span - time.time()))
                    self.say(f"soak: {event.__name__} at {time.time() - self.log.started:.0f} s")
                    event()
            for t in threads:
                t.join(timeout=max(1.0, self.stop_at - time.time()) + TIMEOUT_S + 30)
            hung = [t.name for t in threads if t.is_alive()]
            final = server.metrics() or {}
            margin = server.probe_margin()
        finally:
            server.stop()
        return summarize(self, hung, final, margin)


# The report --------------------------------------------------------------------------------


def p95(xs: List[float]) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else None


def summarize(soak: Soak, hung: List[str], final: dict, margin: Optional[float]) -> dict:
    cfg, log = soak.cfg, soak.log
    span = cfg.minutes * 60
    reqs = log.requests
    checked = [r for r in reqs if r.get("kind") in ("short", "long", "chat")]
    differ = [r for r in checked if not r["same"]]
    near = [r for r in differ if margin is not None and r.get("margin") is not None and r["margin"] < margin]
    sampled = [r for r in reqs if r.get("kind") == "sampled"]
    bad = [r for r in reqs if r.get("kind") in ("bad", "oversize")]
    hang = [r for r in reqs if r.get("kind") == "hang-up"]
    errors = [r for r in reqs if r.get("kind") == "error"]
    kill = next((e for e in log.events if e["event"] == "kill"), None)
    reload = next((e for e in log.events if e["event"] == "reload"), None)

    growth = rss_growth(log.samples)
    window = min(600.0, span / 6)
    first = [r for r in checked if r["t"] < window and not r["during_kill"]]
    last = [r for r in checked if r["t"] > span - window and not r["during_kill"]]
    short_ttft = lambda rows: p95([r["ttft"] for r in rows if r["kind"] == "short"])
    gap = lambda rows: p95([g for r in rows for g in r["gaps"]])
    spans = [(s["sent"], s["t"]) for s in log.long]
    alone = lambda rows: [r for r in rows if not any(a < r["t"] and b > r["t"] - r["seconds"] for a, b in spans)]
    gaps, every = [gap(alone(first)), gap(alone(last))], [gap(first), gap(last)]
    ttfts = [short_ttft(first), short_ttft(last)]
    aborted = sum((m.get("aborted_requests") or 0) for m in (final.get("models") or {}).values())
    hang_after_kill = [r for r in hang if kill is None or r["t"] > kill["t"]]
    boot = soak.boot_s
    latency = p95([r["seconds"] for r in checked if r["kind"] == "short"])
    disk_max = max((s["disk"] for s in log.samples), default=0)

    lines = {
        "rss_growth_after_warm_up": {"value": growth, "ok": bool(growth) and max(growth) <= 0.05,
                                     "want": "<= 5% in each server lifetime"},
        "disk_tier_within_budget": {"value": disk_max, "ok": disk_max <= cfg.ssd_cache_bytes,
                                    "want": f"<= {cfg.ssd_cache_bytes} bytes"},
        "greedy_replies_plain": {"value": f"{len(checked) - len(differ)}/{len(checked)} identical, "
                                          f"{len(near)} near-ties", "ok": len(differ) == len(near) and bool(checked),
                                 "want": "identical, or a near-tie under the probe's max |d|"},
        "seeded_replies_repeat": {"value": f"{sum(r['same'] for r in sampled)}/{len(sampled)}",
                                  "ok": all(r["same"] for r in sampled), "want": "all"},
        "bad_requests_4xx_in_shape": {"value": f"{sum(r['shaped'] for r in bad)}/{len(bad)}",
                                      "ok": all(r["shaped"] for r in bad), "want": "all"},
        "hang_ups_counted": {"value": f"{aborted} counted, {len(hang_after_kill)} made since the last start",
                             "ok": aborted >= len(hang_after_kill), "want": "every hang-up in aborted_requests"},
        "no_client_hung": {"value": hung, "ok": not hung, "want": "every client thread ended"},
        "errors_only_at_the_kill": {"value": f"{sum(not r['during_kill'] for r in errors)} outside, "
                                             f"{sum(r['during_kill'] for r in errors)} at the kill",
                                    "ok": not any(not r["during_kill"] for r in errors), "want": "none outside"},
        "p95_ttft_short_stable": {"value": ttfts, "ok": _stable(*ttfts, span), "want": "last within 1.5x of first"},
        "p95_token_gap_stable": {"value": gaps, "ok": _stable(*gaps, span),
                                 "want": "last within 1.5x of first, replies decoded with no long prompt in the server "
                                         f"(all replies: {_fmt(every[0])}, {_fmt(every[1])})"},
    }
    if kill is not None:
        lines["restart_answers_in_time"] = {
            "value": kill["first_answer_s"], "ok": kill["first_status"] == 200 and boot is not None
            and latency is not None and kill["first_answer_s"] <= boot * 1.5 + latency,
            "want": f"<= first start to a first reply {boot or 0:.1f} s x1.5 + p95 short request {latency or 0:.1f} s"}
        lines["disk_tier_serves_after_restart"] = {"value": kill["ssd_hits_after"], "ok": kill["ssd_hits_after"] > 0,
                                                   "want": "> 0 disk hits"}
    if reload is not None:
        lines["reload_applied_when_idle"] = {"value": reload["applied"], "ok": reload["applied"], "want": True}
    counts = {}
    for r in reqs:
        counts[r.get("kind")] = counts.get(r.get("kind"), 0) + 1
    return {"config": {**asdict(cfg), "machine": describe(), "probe_max_abs_diff": margin},
            "lines": lines, "counts": counts, "differing": differ[:50], "unshaped": [r for r in bad if not r["shaped"]][:20],
            "errors": errors[:50],
            "events": log.events, "long_prompts": log.long,
            "samples": [_sample(s) for s in log.samples],
            "latency": [{"t": r["t"], "kind": r["kind"], "seconds": r["seconds"], "ttft": r["ttft"],
                         "gap_p95": p95(r["gaps"])} for r in checked],
            "final_metrics": final}


def rss_growth(samples: List[dict]) -> List[float]:
    """Each server lifetime's RSS growth after its warm-up: the floor (``FLOOR`` percentile)
    of its last fifth over that of its first.  The floor is what the server comes back to
    between requests; a long prompt's caches in flight lift the samples taken meanwhile by a
    gigabyte, so a median would follow how many long prompts each fifth held, not a leak."""
    growth = []
    for n in sorted({s["lifetime"] for s in samples}):
        rows = [s["rss"] for s in samples if s["lifetime"] == n and s["rss"]]
        if len(rows) < 4:
            continue
        rows = rows[int(len(rows) * WARM_UP) + 1:]
        k = max(1, len(rows) // 5)
        growth.append(_floor(rows[-k:]) / _floor(rows[:k]) - 1)
    return growth


def _floor(xs: List[int]) -> int:
    return sorted(xs)[int(FLOOR * len(xs))]


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _sample(s: dict) -> dict:
    """A sample as the report keeps it: RSS, disk, and each model's requests running and
    queued (what a stall is read from), not the whole ``/metrics``."""
    models = (s.get("metrics") or {}).get("models") or {}
    return {**{k: v for k, v in s.items() if k != "metrics"},
            "running": {m: [x.get("active_requests"), x.get("queued_requests")] for m, x in models.items()}}


def _stable(first, last, span: float, factor: float = 1.5) -> Optional[bool]:
    """Whether ``last`` is within ``factor`` of ``first``.  A window with no such reply cannot
    be judged: in a run shorter than ``JUDGED_MINUTES`` (a smoke run, its windows a few
    seconds) the line is not judged (None); in a longer one a window without a reply is a
    stall, and fails."""
    if first is None or last is None:
        return None if span < JUDGED_MINUTES * 60 else False
    return last <= first * factor


def failed_lines(report: dict) -> List[str]:
    return [k for k, line in report["lines"].items() if line["ok"] is False]


def unjudged_lines(report: dict) -> List[str]:
    return [k for k, line in report["lines"].items() if line["ok"] is None]


def markdown(report: dict) -> str:
    cfg = report["config"]
    out = [f"# Soak: {cfg['minutes']:g} min, {cfg['clients']} clients (seed {cfg['seed']})", "",
           f"Machine: {cfg['machine'].get('platform')}, {cfg['machine'].get('cpus')} cores, "
           f"{cfg['machine'].get('blas') or 'MLX BLAS'}.  Requests by kind: "
           + ", ".join(f"{k} {v}" for k, v in sorted(report["counts"].items(), key=lambda kv: str(kv[0]))) + ".", "",
           "| expectation | measured | wanted | holds |", "|---|---|---|---|"]
    for name, line in report["lines"].items():
        value = line["value"]
        if isinstance(value, float):
            value = f"{value:.3g}"
        elif isinstance(value, list):
            value = ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in value) or "-"
        out.append(f"| {name.replace('_', ' ')} | {value} | {line['want']} | {HOLDS[line['ok']]} |")
    return "\n".join(out) + "\n"


def plot(report: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    rows = [s for s in report["samples"] if s["rss"]]
    a.plot([s["t"] / 60 for s in rows], [s["rss"] / 2**20 for s in rows], ".-", ms=2)
    a.set_ylabel("server RSS (MiB)")
    lat = sorted(report["latency"], key=lambda r: r["t"])
    step = max(60.0, report["config"]["minutes"] * 60 / 30)
    buckets = {}
    for r in lat:
        buckets.setdefault(int(r["t"] // step), []).append(r)
    keys = sorted(buckets)
    at = [(k + 0.5) * step / 60 for k in keys]
    b.plot(at, [p95([r["seconds"] for r in buckets[k]]) for k in keys], "o-", label="request")
    b.set_ylabel("p95 request latency (s)")
    c = b.twinx()  # a streamed reply's own p95 gap, its p95 over the bucket's replies
    c.plot(at, [p95([r.get("gap_p95") for r in buckets[k]]) for k in keys], "s--", color="tab:orange",
           label="token gap")
    c.set_ylabel("p95 token gap (s)")
    b.legend(handles=b.get_lines() + c.get_lines(), loc="upper left")
    b.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict, out: Path) -> List[Path]:
    out = Path(out)
    def figures(report, out_dir):
        plot(report, out_dir / "soak.png")
        return [out_dir / "soak.png"]

    return write_files(out, "soak", report, markdown(report), figures)


def run_soak(cfg: SoakConfig, work_dir: Path, home: Optional[Path] = None, say: Callable[[str], None] = print) -> dict:
    return Soak(cfg, work_dir, home, say).run()
