"""Speculative-decoding metrics with the exact definitions of ALGORITHMS.md.

Counts per request, summed over a workload: N_gen generated tokens, N_T
target verification steps, N_D draft tokens proposed, N_acc accepted; and
N_drawn, every draft token the draft computed, verified or not (a policy
that drops y_t after looking at q_t paid the forward that produced q_t; a
rule that trims after drafting paid for every trimmed token). The draft side
of the modeled speedup is charged on N_drawn where it is recorded. Also
the greedy simulators used for the oracle: given whether the draft's greedy
token matches the target's at each generated position (one teacher-forced
draft pass over the target's greedy output), a fixed-K run and the oracle
stop are fully determined.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecCounts:
    n_gen: int = 0  # generated tokens
    n_target: int = 0  # target verification steps
    n_draft: int = 0  # draft tokens proposed
    n_accepted: int = 0  # draft tokens accepted
    n_drawn: int = 0  # draft tokens computed, verified or dropped (0: not recorded, then N_D)
    n_tail: int = 0  # of N_D, the context tail's: tokens the request's context predicted, no draft forward
    accepted_hist: Counter = field(default_factory=Counter)  # accepted length per step -> steps
    accepted_per_pos: list[int] = field(default_factory=list)  # [K] steps whose draft j was accepted
    drafted_per_pos: list[int] = field(default_factory=list)  # [K] steps that drafted a token at j

    @property
    def mean_acceptance_length(self) -> float:  # tau = N_gen / N_T
        return self.n_gen / self.n_target if self.n_target else float("nan")

    @property
    def discard_rate(self) -> float:
        return (self.n_draft - self.n_accepted) / self.n_gen if self.n_gen else float("nan")

    @property
    def verification_rate(self) -> float:
        return self.n_target / self.n_gen if self.n_gen else float("nan")

    @property
    def draft_cost_tokens(self) -> int:  # what the draft side is charged for: N_drawn, else N_D (less the tail)
        return max(self.n_drawn, self.n_draft - self.n_tail)

    def modeled_speedup(self, c: float, overhead: float = 0.0) -> float:
        return modeled_speedup(self.n_gen, self.n_target, self.draft_cost_tokens, c, overhead)

    def passes_by_drafts(self) -> dict[int, int]:
        """Target passes per number of drafts they verified (0: prefills, rounds that drafted nothing)."""
        drafted = lengths_from_per_pos(self.drafted_per_pos)
        return {m: n for m, n in {0: self.n_target - sum(drafted.values()), **drafted}.items() if n}

    def priced_speedup(self, verify_ms: list[float], draft_ms: float) -> float:
        """S on a machine's measured step costs instead of one ratio c (`priced_speedup`)."""
        return priced_speedup(self.n_gen, self.passes_by_drafts(), self.draft_cost_tokens, verify_ms, draft_ms)

    def add(self, other: SpecCounts) -> None:
        self.n_gen += other.n_gen
        self.n_target += other.n_target
        self.n_draft += other.n_draft
        self.n_accepted += other.n_accepted
        self.n_drawn += other.n_drawn
        self.n_tail += other.n_tail
        self.accepted_hist.update(other.accepted_hist)
        self.accepted_per_pos = _add_lists(self.accepted_per_pos, other.accepted_per_pos)
        self.drafted_per_pos = _add_lists(self.drafted_per_pos, other.drafted_per_pos)

    def record_step(self, drafted: int, accepted: int) -> None:
        """One target step that verified `drafted` tokens and accepted `accepted`."""
        self.n_target += 1
        self.n_gen += accepted + 1
        self.n_draft += drafted
        self.n_accepted += accepted
        self.accepted_hist[accepted] += 1
        _count_prefix(self.drafted_per_pos, drafted)
        _count_prefix(self.accepted_per_pos, accepted)

    def as_dict(self) -> dict:
        return {
            "n_gen": self.n_gen,
            "n_target": self.n_target,
            "n_draft": self.n_draft,
            "n_accepted": self.n_accepted,
            "n_drawn": self.n_drawn,
            "n_tail": self.n_tail,
            "accepted_hist": dict(sorted(self.accepted_hist.items())),
            "drafted_per_pos": list(self.drafted_per_pos),
            "accepted_per_pos": list(self.accepted_per_pos),
        }


def lengths_from_per_pos(per_pos: list[int]) -> dict[int, int]:
    """per_pos[j]: drafts reaching position j -> {draft length: count}."""
    padded = [*per_pos, 0]
    return {j + 1: padded[j] - padded[j + 1] for j in range(len(per_pos)) if padded[j] > padded[j + 1]}


def _count_prefix(per_pos: list[int], n: int) -> None:
    """per_pos[j] += 1 for j < n, in place (grown as needed): once per request per engine step."""
    if len(per_pos) < n:
        per_pos.extend([0] * (n - len(per_pos)))
    for j in range(n):
        per_pos[j] += 1


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    width = max(len(a), len(b))
    return [(a[j] if j < len(a) else 0) + (b[j] if j < len(b) else 0) for j in range(width)]


def replay_row(key: dict, counts: SpecCounts, c: float) -> dict:
    """One row of a replay table: `key` (the setting) with tau, draft tokens per generated
    token, discard rate and S(c), rounded for reports."""
    return {
        **key,
        "tau": round(counts.mean_acceptance_length, 4),
        "draft_per_token": round(counts.n_draft / counts.n_gen, 4),
        "discard_rate": round(counts.discard_rate, 4),
        "speedup": round(counts.modeled_speedup(c), 4),
    }


def modeled_speedup(n_gen: int, n_target: int, n_draft: int, c: float, overhead: float = 0.0) -> float:
    """S(c) = 1 / (N_T/N_gen + (N_D/N_gen)/c + o), SpecDec++ eq. 3.1.

    `overhead` (o) is the stopping policy's own time per generated token in
    units of one target step.
    """
    return 1.0 / (n_target / n_gen + (n_draft / n_gen) / c + overhead)


def priced_speedup(n_gen: int, passes: dict[int, int], n_drawn: int, verify_ms: list[float], draft_ms: float) -> float:
    """S when a pass that verifies m drafts costs verify_ms[1 + m] (a pass over 1 + m tokens, as measured:
    on a CPU it grows with m, on a GPU at batch 1 it hardly does) and each drawn draft draft_ms, against
    no speculation's N_gen passes of verify_ms[1]. passes: m -> passes (`SpecCounts.passes_by_drafts`).
    With verify_ms constant at t_T and draft_ms = t_T / c this is `modeled_speedup` at c."""
    spent = sum(n * verify_ms[min(1 + m, len(verify_ms) - 1)] for m, n in passes.items()) + n_drawn * draft_ms
    return n_gen * verify_ms[1] / spent


def overlapped_speedup(n_gen: int, n_target: int, n_drawn: int, c: float, n_sequential: int = 0) -> float:
    """S(c) when the draft runs beside the target (PEARL) with ideal overlap: each target step costs the
    longer of one target pass and its share of the parallel draft work, (N_par / N_T) / c target passes,
    with N_par = N_drawn - N_seq; drafts made while the target waited (N_seq, pearl's pre_draft) add 1/c each.

    1 / ((N_T / N_gen) * max(1, (N_par / N_T) / c) + (N_seq / N_gen) / c), steps drafting alike."""
    parallel = (n_drawn - n_sequential) / n_target / c
    return 1.0 / ((n_target / n_gen) * max(1.0, parallel) + n_sequential / n_gen / c)


def chain_runs(match: list[bool]) -> list[int]:
    """runs[i]: how many drafts from position i agree with the target in a row, when the
    draft's i-th prediction does not depend on its own earlier drafts (a draft model read
    teacher-forced: while it agrees, its inputs are the target's tokens)."""
    runs = [0] * (len(match) + 1)
    for i in range(len(match) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if match[i] else 0
    return runs[:-1]


def simulate_greedy(match: list[bool], k: int, oracle: bool = False, runs: list[int] | None = None) -> SpecCounts:
    """Replay greedy speculative decoding over one request, counting passes as the engine does.

    match[i] is True when the draft's greedy token equals the target's i-th
    generated token, given the target's prefix. Token 0 comes from the
    prefill pass, which verifies no drafts. Every later pass, at position i,
    drafts K tokens (fixed) or exactly the agreeing run (oracle), both capped
    at the n - i - 1 tokens the request can still accept (no draft past
    max_tokens, as the plugin does); it accepts min(run, cap) and emits one
    target token more. N_T therefore counts every pass that generated a token,
    the prefill's included, exactly as the plugin's per-step records do.
    `runs` (one per position, as `chain_runs` gives) replaces the runs derived
    from `match`: a drafter that reads its own last state (EAGLE) has to be
    unrolled from each position to know them.
    """
    runs = chain_runs(match) if runs is None else runs
    n = len(runs)
    counts = SpecCounts(n_gen=n, accepted_per_pos=[0] * k)
    if n == 0:
        return counts
    counts.n_target, counts.accepted_hist[0] = 1, 1  # the prefill pass: token 0, no drafts
    i = 1
    while i < n:
        cap = min(k, n - i - 1)
        accepted = min(runs[i], cap)
        counts.n_target += 1
        counts.n_draft += accepted if oracle else cap
        counts.n_accepted += accepted
        counts.accepted_hist[accepted] += 1
        for j in range(accepted):
            counts.accepted_per_pos[j] += 1
        i += accepted + 1
    return counts


def simulate_workload(
    matches: list[list[bool]], k: int, oracle: bool = False, runs: list[list[int]] | None = None
) -> SpecCounts:
    """simulate_greedy over requests; `runs` per request replaces the runs derived from `matches`."""
    total = SpecCounts(accepted_per_pos=[0] * k)
    for i, match in enumerate(matches):
        total.add(simulate_greedy(match, k, oracle, None if runs is None else runs[i]))
    return total
