"""What several test modules share: exact reference distributions and the chi-square test
for sampling, plain / DFlash token runs, and a cache's state as arrays.  (The tiny models
themselves are in ``tiny_models.py``, which is also a script.)"""

from collections import defaultdict
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from openai import OpenAI
from scipy import stats as sstats

from dflash2_mlx.generate import load, stream_generate
from dflash2_mlx.generate import speculative_generate_step
from dflash2_mlx.loop.target import attach
from dflash2_mlx.model.target_model import model_args
from dflash2_mlx.request.sampling import SamplingParams
from tiny_models import byte_chars


def ref_probs(logits, history, temp, top_p=1.0, top_k=0, min_p=0.0, rep=None, xtc=None):
    x = np.array(logits, dtype=np.float64)
    if rep is not None:
        penalty, ctx = rep
        for t in set(history[-ctx:]):
            x[t] = x[t] * penalty if x[t] < 0 else x[t] / penalty
    lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    keep = np.ones_like(lp, dtype=bool)
    if 0 < top_p < 1:
        p = np.exp(lp)
        for j in range(len(lp)):
            keep[j] &= p[p > p[j]].sum() < top_p
    if min_p:
        keep &= lp >= lp[keep].max() + np.log(min_p)

    def finish(keep):
        keep = keep.copy()
        if top_k:
            order = np.argsort(-np.where(keep, lp, -np.inf))
            keep[order[top_k:]] = False
        z = np.where(keep, lp / temp, -np.inf)
        e = np.exp(z - z.max())
        return e / e.sum()

    if xtc is None:
        return finish(keep)
    # XTC: with chance P, drop every token likelier than the least likely one above the
    # threshold (of the distribution top-p / min-p left), special tokens excepted.
    P, threshold, special = xtc
    pf = np.where(keep, np.exp(lp), 0.0)
    pf /= pf.sum()
    cut = np.zeros_like(keep)
    if (pf > threshold).any():
        cut = pf > pf[pf > threshold].min()
        cut[list(special)] = False
    return (1 - P) * finish(keep) + P * finish(keep & ~cut)


def exact_joint(model, prompt, n, **kw):
    V = model_args(model).vocab_size
    joint = {}

    def rec(prefix, prob):
        if len(prefix) == n:
            joint[tuple(prefix)] = prob
            return
        logits = model(mx.array([prompt + prefix]))[0, -1].astype(mx.float32)
        p = ref_probs(np.array(logits), prompt + prefix, **kw)
        for t in range(V):
            if p[t] > 0:
                rec(prefix + [t], prob * p[t])

    rec([], 1.0)
    return joint


def chi2_pvalue(counts, joint, n):
    keys = sorted(joint, key=lambda k: -joint[k])
    exp = np.array([joint[k] * n for k in keys])
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    outside = n - obs.sum()
    assert outside == 0, f"{outside} samples fell on outcomes of probability zero"
    big = exp >= 5
    exp_b = np.append(exp[big], exp[~big].sum())
    obs_b = np.append(obs[big], obs[~big].sum())
    if exp_b[-1] < 5:  # fold a small remainder into the smallest kept bin
        exp_b[-2] += exp_b[-1]
        obs_b[-2] += obs_b[-1]
        exp_b, obs_b = exp_b[:-1], obs_b[:-1]
    return sstats.chisquare(obs_b, exp_b).pvalue


def params_of(kw) -> SamplingParams:
    xtc = kw.get("xtc")
    other = {k: v for k, v in kw.items() if k != "xtc"}
    if xtc is None:
        return SamplingParams(**other)
    return SamplingParams(**other, xtc_probability=xtc[0], xtc_threshold=xtc[1], xtc_special_tokens=xtc[2])


def plain_tokens(model, prompt, n, processors=None):
    gen = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=processors)
    return [int(t) for t, _ in gen]


def dflash_tokens(model, drafter, prompt, n, block_size, processors=None, lookup=True):
    target = attach(model, drafter)
    steps = speculative_generate_step(mx.array(prompt), target, drafter, max_tokens=n,
                                      block_size=block_size, logits_processors=processors,
                                      lookup=lookup)
    tokens, stats = [], None
    for t, _, _, stats in steps:
        tokens.append(t)
    return tokens, stats


def cache_arrays(cache):
    """Every array that defines a cache's state, trimmed to its valid length."""
    out = []
    for c in cache:
        if c.is_trimmable():
            k, v = c.keys_and_values() if hasattr(c, "keys_and_values") else c.state[:2]
            out += [np.array(k), np.array(v)]
        else:
            out += [np.array(a) for a in c.cache]
    return out


# Server harness ------------------------------------------------------------------------
# `dflash2-mlx serve` as a real process on loopback (test_server, test_batch_server).

NO_EOS = {"1": -100}  # the tiny tokenizer's <eos>: keeps long generations going
CHAT = [{"role": "user", "content": "say hi"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command():
    script = Path(sys.executable).with_name("dflash2-mlx")
    return [str(script)] if script.exists() else [sys.executable, "-m", "dflash2_mlx.cli.main"]


def start_server(root: Path, args, env=None):
    """`serve ARGS` on a free loopback port, its output in root/server.log; (process, base)."""
    port = free_port()
    with open(root / "server.log", "w") as log:
        proc = subprocess.Popen(serve_command() + ["serve", "--port", str(port), *map(str, args)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        assert proc.poll() is None, (root / "server.log").read_text()
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not start"
        time.sleep(0.2)


def stop_server(proc):
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def metrics(server, headers=None, timeout=5.0) -> dict:
    return httpx.get(server["base"] + "/metrics", headers=headers, timeout=timeout).json()


def tool_variant(src: Path, dst: Path, template: str) -> Path:
    """The model at ``src`` served from ``dst`` with chat template ``template`` and
    mlx-lm's json_tools parser (the rest of its files linked, not copied)."""
    dst.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((Path(src) / "tokenizer_config.json").read_text())
    config.update(chat_template=template, tool_parser_type="json_tools")
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def counters(m: dict, model: str) -> dict:
    """``model``'s counters in /metrics body ``m``; zeros for a model not loaded yet (so a
    test that compares before and after may run first)."""
    return defaultdict(int, m["models"].get(model, {}))


def wait_idle(server, timeout=20.0, headers=None) -> dict:
    """/metrics once no request is running (``headers``: the API key a server needs)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(server, headers)
        if not m["active_requests"]:
            return m
        time.sleep(0.05)
    raise AssertionError(f"generation did not stop: {m}")


def greedy_ids(target, messages, n: int):
    """The first ``n`` token ids of the greedy reply of ``target`` to ``messages``, and its
    tokenizer (run on the MLX worker thread)."""
    model, tokenizer, _ = load(str(target))
    return [r.token for r in stream_generate(model, tokenizer, messages, max_tokens=n)], tokenizer


def cut_inside_an_emoji(ids, tokenizer) -> int:
    """The first max_tokens that ends on an emoji's lead piece after some clean text; 0 if none."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    for k in range(2, len(ids)):
        clean = tokenizer.decode(ids[: k - 1])
        if pieces[k - 1].startswith(byte_chars()[0xF0]) and "\ufffd" not in clean:
            return k
    return 0


def all_four_replies(base: str, max_tokens: int) -> list:
    """Chat and completion replies to the same prompt ids, each non-streaming and streaming."""
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = dict(model="emoji", messages=CHAT, max_tokens=max_tokens)
    plain = dict(model="emoji", prompt="u:say hi.a:", max_tokens=max_tokens)  # the chat's rendered text
    return [client.chat.completions.create(**chat).choices[0].message.content,
            "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True)),
            client.completions.create(**plain).choices[0].text,
            "".join(c.choices[0].text for c in client.completions.create(**plain, stream=True))]
