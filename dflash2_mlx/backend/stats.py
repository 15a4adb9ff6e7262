"""Running statistics of an engine: requests, tokens, tau, acceptance by position, speed."""

import threading
import time
from typing import Dict, List


class EngineStats:
    """Totals over finished requests plus the live counters; safe to read from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests = 0  # finished (completed, stopped, aborted or failed)
        self.aborted = 0
        self.failed = 0
        self.rejected = 0  # refused at the door (queue full)
        self.plain_fallbacks = 0  # requests decoded without the drafter (dflash_max_ctx)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.generation_seconds = 0.0
        self.prompt_seconds = 0.0
        self.cycles = 0
        self.accepted_length = 0  # sum over cycles of (accepted + 1)
        self.position_accepted: List[int] = []
        self.block_sizes: Dict[int, int] = {}  # cycles per block size
        self.adaptive_fallbacks = 0  # requests that ended decoding plain (adaptive mode)
        self.last_generation_tps = 0.0
        self.last_tau = 0.0
        self.active = 0
        self.queued = 0
        self.batch_steps = 0  # steps of the batch job (one cycle for all its sequences)
        self.batch_sequences = 0  # sum over those steps of the sequences in the batch
        self.batch_peak = 0

    def add(self, *, prompt_tokens=0, generation_tokens=0, prompt_seconds=0.0,
            generation_seconds=0.0, cycles=0, tau=0.0, position_accepted=(),
            plain=False, finish_reason=None, block_sizes=None, fallback=False):
        with self._lock:
            self.requests += 1
            self.aborted += finish_reason == "abort"
            self.failed += finish_reason == "error"
            self.plain_fallbacks += bool(plain)
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.prompt_seconds += prompt_seconds
            self.generation_seconds += generation_seconds
            self.cycles += cycles
            self.accepted_length += round(tau * cycles)
            if len(self.position_accepted) < len(position_accepted):
                self.position_accepted += [0] * (len(position_accepted) - len(self.position_accepted))
            for i, n in enumerate(position_accepted):
                self.position_accepted[i] += n
            for b, n in (block_sizes or {}).items():
                self.block_sizes[b] = self.block_sizes.get(b, 0) + n
            self.adaptive_fallbacks += bool(fallback)
            if generation_tokens:
                self.last_generation_tps = generation_tokens / max(generation_seconds, 1e-9)
            if cycles:
                self.last_tau = tau

    def batch_step(self, sequences: int):
        with self._lock:
            self.batch_steps += 1
            self.batch_sequences += sequences
            self.batch_peak = max(self.batch_peak, sequences)

    def move(self, queued=0, active=0, rejected=0):
        with self._lock:
            self.queued += queued
            self.active += active
            self.rejected += rejected

    def snapshot(self) -> dict:
        with self._lock:
            c = self.cycles
            return {
                "requests": self.requests,
                "active_requests": self.active,
                "queued_requests": self.queued,
                "aborted_requests": self.aborted,
                "failed_requests": self.failed,
                "rejected_requests": self.rejected,
                "plain_fallbacks": self.plain_fallbacks,
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "cycles": c,
                "mean_tau": self.accepted_length / c if c else 0.0,
                "acceptance_by_position": [n / c for n in self.position_accepted] if c else [],
                "accepted_by_position": list(self.position_accepted),
                "block_sizes": dict(sorted(self.block_sizes.items())),
                "adaptive_fallbacks": self.adaptive_fallbacks,
                "generation_tps": self.generation_tokens / self.generation_seconds
                if self.generation_seconds else 0.0,
                "prompt_tps": self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0,
                "last_generation_tps": self.last_generation_tps,
                "last_tau": self.last_tau,
                "batch_steps": self.batch_steps,
                "mean_batch_size": self.batch_sequences / self.batch_steps if self.batch_steps else 0.0,
                "peak_batch_size": self.batch_peak,
                "uptime_s": time.time() - self.started,
            }
