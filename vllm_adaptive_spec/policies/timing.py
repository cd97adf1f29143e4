"""Time a policy inside the engine: `adaptive_spec.time_policy = true`.

This measures what a policy costs in the real draft loop, with the real
batch shapes, contexts and round lengths (the benchmark harness runs every
plugin configuration with it on). `TimedPolicy` wraps the
policy and adds up the wall time of every call the proposer makes to it;
the proposer adds up its whole `propose` time, so

    policy share = policy_s / (propose_s - policy_s)

is the policy's time relative to everything else the draft side does
(first pass, draft forwards, logits, sampling, metadata). `sync` (e.g.
torch.cuda.synchronize) makes the figures exact on an asynchronous device;
on CPU every op is synchronous and no sync is needed. Off by default: it
costs a few perf_counter calls per draft step, plus the syncs on a GPU.

The same clock splits the rest of an engine step, to find where a step's time
goes when the wall clock disagrees with the counts: on steady decode rounds
(the same requests as the round before, all decoding) `steady_gap_s` is the
time from one round's drafts to the next round's start (the target's forward,
sampling, the scheduler, the engine's output), `steady_target_s` the target's
forwards inside those gaps; `gc_s` is the time this process spent in Python's
garbage collector while the clock ran (every engine in the process).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy


@dataclass
class Clock:
    policy_s: float = 0.0  # inside the policy's calls
    propose_s: float = 0.0  # whole propose() calls, the policy's included
    rounds: int = 0
    decides: int = 0  # decide calls = draft steps of the batch
    steady_rounds: int = 0  # rounds that followed a steady decode step
    steady_gap_s: float = 0.0  # their engine steps outside the draft loop
    steady_target_s: float = 0.0  # the target's forwards in those steps
    gc_s: float = 0.0  # Python's garbage collector, this process
    gc_runs: int = 0
    last_target_s: float = 0.0  # the target's latest forward (a steady round adds it)
    _gc_start: float | None = field(default=None, repr=False)

    def add_steady_gap(self, seconds: float) -> None:
        self.steady_rounds += 1
        self.steady_gap_s += seconds
        self.steady_target_s += self.last_target_s

    def watch_gc(self) -> None:
        """Add the garbage collector's pauses in this process to `gc_s` from now on."""
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_runs += 1
            self._gc_start = None

    def as_dict(self) -> dict:
        draft_s = self.propose_s - self.policy_s
        return {
            "policy_s": round(self.policy_s, 6),
            "propose_s": round(self.propose_s, 6),
            "rounds": self.rounds,
            "decides": self.decides,
            "steady_rounds": self.steady_rounds,
            "steady_gap_s": round(self.steady_gap_s, 6),
            "steady_target_s": round(self.steady_target_s, 6),
            "gc_s": round(self.gc_s, 6),
            "gc_runs": self.gc_runs,
            "policy_share": round(self.policy_s / draft_s, 5) if draft_s > 0 else None,
            "policy_us_per_decide": round(1e6 * self.policy_s / self.decides, 2) if self.decides else None,
        }


class TimedPolicy(StopPolicy):
    """Delegates every call to `inner`, adding the time spent in it to `clock`."""

    def __init__(self, inner: StopPolicy, clock: Clock, sync: Callable[[], None] | None = None):
        self.inner, self.clock, self._sync = inner, clock, sync
        self.name = inner.name
        self.observes_context = inner.observes_context
        self.trims = inner.trims
        self.reads_tokens = inner.reads_tokens
        self.gate_min_rows = inner.gate_min_rows

    def _start(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    def _stop(self, start: float) -> None:
        if self._sync is not None:
            self._sync()
        self.clock.policy_s += time.perf_counter() - start

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.inner.device

    @device.setter
    def device(self, value: torch.device) -> None:
        self.inner.device = value

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        start = self._start()
        out = self.inner.round_limits(req_ids, cap)
        self._stop(start)
        self.clock.rounds += 1
        return out

    def observe_context(self, req_ids, hidden, starts, lengths, positions) -> None:
        start = self._start()
        self.inner.observe_context(req_ids, hidden, starts, lengths, positions)
        self._stop(start)

    def tokens_seen(self, req_id: str) -> int:
        return self.inner.tokens_seen(req_id)

    def observe_tokens(self, req_ids: list[str], new: list[list[int]]) -> None:
        start = self._start()
        self.inner.observe_tokens(req_ids, new)
        self._stop(start)

    def decide(self, logp, tokens, t, hidden=None) -> StepDecision:
        start = self._start()
        out = self.inner.decide(logp, tokens, t, hidden)
        self._stop(start)
        self.clock.decides += 1
        return out

    def gate_top(self, top: torch.Tensor) -> torch.Tensor:
        return self.inner.gate_top(top)  # the proposer calls it inside the gate's timed block

    def admit(self, lengths: torch.Tensor) -> torch.Tensor:
        start = self._start()
        out = self.inner.admit(lengths)
        self._stop(start)
        return out

    def end_round(self, req_ids, drafted, accepted) -> None:
        start = self._start()
        self.inner.end_round(req_ids, drafted, accepted)
        self._stop(start)

    def forget(self, req_id: str) -> None:
        self.inner.forget(req_id)

    def num_tracked(self) -> int:
        return self.inner.num_tracked()
