"""Per-request and per-workload statistics of adaptive speculation.

Host-side bookkeeping, updated once per engine step (never per draft token).
Counts follow ALGORITHMS.md: a target step of a request generates its
accepted drafts plus one token of the target's own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm_adaptive_spec.metrics import SpecCounts
from vllm_adaptive_spec.policies.timing import Clock


@dataclass
class StatsBook:
    live: dict[str, SpecCounts] = field(default_factory=dict)  # running requests
    finished: SpecCounts = field(default_factory=SpecCounts)  # sum over finished requests
    n_finished: int = 0
    forwards_per_step: Counter = field(default_factory=Counter)  # draft forward passes -> engine steps
    drafted_len_hist: Counter = field(default_factory=Counter)  # proposed draft length -> rounds
    rows_saved: int = 0  # compact_drafts: row computations draft forwards left out (rows that had stopped)
    tail_tokens: int = 0  # context_tail: draft tokens the requests' contexts added after the drafter's
    tail_cut: int = 0  # tail_gate: tail tokens the contexts offered that the gate cut (not in tail_tokens)
    # context_tail: tokens each round proposed for verification, drafts and tail -> rounds (empty without a
    # tail: then it is drafted_len_hist); what a round's target pass verifies, for pricing passes by length
    proposed_len_hist: Counter = field(default_factory=Counter)
    clock: Clock | None = None  # set with adaptive_spec.time_policy

    def record_verification(self, req_ids: list[str], drafted: list[int], generated: list[int]) -> None:
        """One engine step: per request, drafts verified and tokens generated (0: not a decode step)."""
        for req_id, n_d, n_g in zip(req_ids, drafted, generated):
            if n_g > 0:
                self._counts(req_id).record_step(drafted=n_d, accepted=n_g - 1)

    def record_proposal(
        self,
        lengths: list[int],
        forwards: int,
        req_ids: list[str] | None = None,
        drawn: list[int] | None = None,
        rows_saved: int | None = None,
    ) -> None:
        """One round: per request, drafts proposed (`lengths`) and drafts computed (`drawn`, dropped ones
        too); rows_saved: row computations its draft forwards left out (compact_drafts)."""
        self.forwards_per_step[forwards] += 1
        self.rows_saved += rows_saved or 0
        self.drafted_len_hist.update(lengths)
        for req_id, n in zip(req_ids or [], drawn or []):
            if n > 0:
                self._counts(req_id).n_drawn += n

    def record_tail(self, req_id: str, n: int) -> None:
        """context_tail: n tokens the request's context predicted, appended after its drafts."""
        self.tail_tokens += n
        self._counts(req_id).n_tail += n

    def record_proposed(self, lengths: list[int]) -> None:
        """context_tail: one round's tokens per request sent to verification (drafts and tail)."""
        self.proposed_len_hist.update(lengths)

    def _counts(self, req_id: str) -> SpecCounts:
        """The live request's counts (created on first use; not `setdefault`, which builds one per call)."""
        counts = self.live.get(req_id)
        if counts is None:
            counts = self.live[req_id] = SpecCounts()
        return counts

    def finish(self, req_id: str) -> None:
        counts = self.live.pop(req_id, None)
        if counts is not None:
            self.finished.add(counts)
            self.n_finished += 1

    def workload(self) -> SpecCounts:
        total = SpecCounts()
        total.add(self.finished)
        for counts in self.live.values():
            total.add(counts)
        return total

    def snapshot(self) -> dict:
        return {
            "workload": self.workload().as_dict(),
            "requests": {r: c.as_dict() for r, c in self.live.items()},
            "n_finished": self.n_finished,
            "forwards_per_step": dict(sorted(self.forwards_per_step.items())),
            "drafted_len_hist": dict(sorted(self.drafted_len_hist.items())),
            "rows_saved": self.rows_saved,
            "tail_tokens": self.tail_tokens,
            "tail_cut": self.tail_cut,
            "proposed_len_hist": dict(sorted(self.proposed_len_hist.items())),
            **({"timing": self.clock.as_dict()} if self.clock is not None else {}),
        }
