"""Batch-aware stopping: does the next draft step pay for the whole batch?

Per-request policies decide for their own row; in a batch every draft step
is one forward of all rows, and every kept draft is one more token for the
target to verify, so a step that adds little expected output for the batch
costs as much as one that adds a lot. The gate runs beside any per-request
policy (on by default for the adaptive ones: `adaptive_spec.batch_aware`)
and ends the round for every row as soon as one more step would lower the
round's expected output per unit of time:

    G  = n + sum over kept drafts of their survival s (expected tokens of the round)
    C  = (t + 1) D(n) + V(n + drafts kept so far)          (its cost so far)
    dG = sum over rows still drafting of s_i * p_i(t + 1)   (what step t + 1 adds)
    dC = D(n) + V(tokens + rows still drafting) - V(tokens)
    draft step t + 1 only if dG / dC > G / C

With `compact_drafts` a draft step costs D of the rows it computes
(`step.rows_to_compute`), in C and in dC alike.

s_i is the running product of the acceptance estimates of `acceptance.py`
(read off the draft distributions, fitted online from what the target
accepted: `BinnedAcceptanceEstimator`, refitted every REFIT_ROUNDS rounds);
p_i(t + 1) is estimated from row i's last distribution with the
intercept of the next position. D(n) and V(x) are the measured cost curves
(`costs.py`). The gate only ever ends a round early, for all rows at once:
every draft it leaves in place was kept by the row's own policy, and the
decision to stop after a kept draft may depend on it (a stopping time,
ALGORITHMS.md), so sampling stays lossless.

Once the rule ends a round of at least HOLD_MIN_ROWS rows after its first
step while rows still wanted to draft, the next HOLD_ROUNDS - 1 rounds of at
least as many rows draft one step with no gate work at all
(`one_step_round`), and then the gate looks again. Below HOLD_MIN_ROWS one
row's confidence decides the verdict, which then says little about the next
round. On the measured curves a second step pays less the more rows there
are (its verification grows with the rows, its gain only with their
acceptance), and at batch 4 to 32 on the toy pair the rule ended every
round after one step: there the gate's per-step work was pure overhead.
The hold is decided before the round's first draft, from earlier rounds
only, so it drops no draft. So is a round with no draft at all
(`no_draft_round`): where one draft a row adds less than it costs on the
curves at the first drafts' counted acceptance rate (compute-bound
verification), the round verifies none, held like the one-step verdict,
with a drafting round after each hold to keep measuring.

With `adaptive_spec.costs = "online"` the curves are measured as the engine
runs (`costs.CostMeter`): the loop times each target pass between two rounds
of the same requests and each draft step after the first pass, at the host
syncs it makes anyway, and every COST_REFRESH_ROUNDS rounds the gate decides
on the measured points, the prior curves' shape scaled to them elsewhere.
A step length the gate never lets the loop draft is never measured: at batch
sizes where it holds one-step rounds the draft curve stays the prior's, scaled.

The gate works on the host, in Python floats, on the one copy of the step's
decisions that the loop makes anyway: at the batch sizes the loop runs (1 to
a few hundred rows) a dozen tiny tensor ops per step cost more than the
arithmetic (benchmarks/gate_cost.py measures both).
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.policies.acceptance import BinnedAcceptanceEstimator, log_odds
from vllm_adaptive_spec.policies.costs import CostMeter, StepCosts
from vllm_adaptive_spec.policies.step import rows_to_compute

HOLD_ROUNDS = 8  # a one-step verdict covers this round and the next 7 (of at least as many rows)
HOLD_MIN_ROWS = 4  # smaller rounds never hold
REFIT_ROUNDS = 50  # the acceptance estimator is refitted this often
COST_REFRESH_ROUNDS = 64  # with measured costs (`online`), the curves are rebuilt this often
FIRST_WINDOW = 4096  # the first drafts' acceptance counts halve past this many


def draft_top(logp: torch.Tensor, tokens: torch.Tensor, greedy: bool) -> torch.Tensor:
    """log q_max of each row. logp [B, V], tokens [B] the drawn ones -> [B].

    When every row is greedy its token is the argmax: a gather, not another pass over the vocabulary
    (that pass was most of the gate's cost at batch 32)."""
    if greedy:
        return logp.gather(1, tokens.long().unsqueeze(1)).squeeze(1)
    return logp.amax(dim=-1)


class Hold:
    """A verdict taken before a round of n rows that also covers the next HOLD_ROUNDS - 1 rounds of at
    least n rows; a smaller round ends it (the verdict was priced at n rows)."""

    def __init__(self):
        self.left, self.rows = 0, 0  # rounds still covered, and the batch size they are covered for

    def start(self, n: int) -> None:
        self.left, self.rows = HOLD_ROUNDS - 1, n

    def covers(self, n: int) -> bool:
        """Before a round of n rows: True when the verdict covers it (one covered round used up)."""
        if self.left > 0 and n >= self.rows:
            self.left -= 1
            return True
        self.left = 0
        return False


class BatchGate:
    def __init__(self, costs: dict, refit_interval: int = REFIT_ROUNDS, online: bool = False):
        """costs: the cost curves (`costs.py`); online: they are only the prior, and the loop's own
        measurements (`meter`) replace them where they exist, every COST_REFRESH_ROUNDS rounds."""
        self.refit_interval = refit_interval
        self.estimator: BinnedAcceptanceEstimator | None = None
        self.costs = StepCosts(costs)
        self.meter = CostMeter(costs) if online else None
        self._metered = 0  # meter.samples when the curves were last rebuilt
        self._rounds = 0
        self._req_ids: list[str] = []
        self._features: list[list[float]] = []  # per row: f of each draft step of this round
        self._preds: list[list[float]] = []  # per row: the acceptance estimate made with it
        self._graded: dict[str, tuple[list[float], list[float]]] = {}  # last round's, until verified
        self._surv: list[float] = []  # per row: survival of its kept drafts
        self._gain = 0.0  # expected tokens of the round so far
        self._compact = False  # the loop compacts its draft batch (compact_drafts)
        self._computed = 0  # rows the last draft step computed
        self._draft_spent = 0.0  # the round's draft steps so far (ms)
        self._verify: list[float] = []  # pass cost per token count, 0..n (cap + 1)
        self._hold = Hold()  # the rule ended a recent round after one step: draft one step, no gate
        self.held_rounds = 0  # rounds drafted as one step without the gate (statistics)
        self._first = [1.0, 2.0]  # first drafts accepted, first drafts verified (a Beta(1, 1) prior)
        self._none = Hold()  # a recent round verified no draft on the gate's verdict
        self._probe = False  # the round after a no-draft hold drafts, to keep measuring what drafting gives
        self.none_rounds = 0  # rounds that verified no draft on the gate's verdict (statistics)

    def no_draft_round(self, n: int, drafting: int, skip_share: float = 0.0) -> bool:
        """Before a round of n rows, `drafting` of which would draft: True when it verifies no draft at
        all, because even one draft a row costs more than it adds for the batch. Decided from earlier
        rounds only (the first drafts' acceptance rate a, counted from verification, and the cost
        curves), never from this round's drafts, so it drops nothing a draft revealed (ALGORITHMS.md):

            n (D(n) + V(n + m)) >= (n + m a) ((1 - s) D(n) + V(n))

        (m = drafting; D(n) the first pass, which reads the verified tokens and draws the first drafts;
        s = skip_share, the share of rounds without drafts whose first pass the drafter skips: 0 where
        it runs every round, 1/2 for a draft model, which skips every other one, `skip_first_pass`.)

        A verdict holds for HOLD_ROUNDS rounds of at least as many rows; the round after them drafts as
        usual, so the rate and (with `online` costs) the cost of a pass with drafts keep being measured."""
        if self._none.covers(n):
            self._probe = self._none.left == 0
            self.none_rounds += 1
            return True
        if self._probe or drafting == 0:
            self._probe = False
            return False
        a = self._first[0] / self._first[1]
        verify = self.costs.verify_list(n + drafting)  # [n + drafting + 1]
        draft = self.costs.draft(n)
        if n * (draft + verify[n + drafting]) < (n + drafting * a) * ((1 - skip_share) * draft + verify[n]):
            return False
        self._none.start(n)
        self.none_rounds += 1
        return True

    def one_step_round(self, n: int) -> bool:
        """Before a round of n rows: True when it drafts one step and skips the gate (a recent round
        of at most n rows ended after one step on the rule); False when the gate runs as usual."""
        if self._hold.covers(n):
            self.held_rounds += 1
            return True
        return False

    def start_round(self, req_ids: list[str], cap: int, compact: bool = False) -> None:
        """compact: the loop's later draft forwards compute only the rows still drafting, once they are
        at most half of the last forward's (`rows_to_compute`)."""
        n = len(req_ids)
        if self.estimator is None or self.estimator.k < cap + 1:  # + 1: it looks one position ahead
            self.estimator = BinnedAcceptanceEstimator(cap + 1)
        self._req_ids = list(req_ids)
        self._features, self._preds = [[] for _ in range(n)], [[] for _ in range(n)]
        self._surv, self._gain = [1.0] * n, float(n)
        self._compact, self._computed, self._draft_spent = compact, n, 0.0
        self._verify = self.costs.verify_list(n * (cap + 1))

    def after_step(self, top: list[float], kept: list[bool], drafting: list[bool], lengths: list[int], t: int) -> bool:
        """After draft step t, per row: top = log q_max of the step's distribution (`draft_top`), kept =
        it kept y_t, drafting = it would draft step t + 1, lengths = drafts kept so far.
        Returns whether step t + 1 pays for the batch."""
        est, surv = self.estimator, self._surv
        last = t + 1 >= est.k
        d_gain = 0.0
        for i, q in enumerate(top):
            f = log_odds(q)
            p = est.acceptance(f, t)  # of y_t
            self._features[i].append(f)
            self._preds[i].append(p)
            if kept[i]:
                surv[i] *= p
                self._gain += surv[i]
            if drafting[i] and not last:
                d_gain += surv[i] * est.acceptance(f, t + 1)  # estimated acceptance of y_{t+1}
        self._draft_spent += self.costs.draft(self._computed)  # step t
        if last:
            return False
        top_index = len(self._verify) - 1
        still = sum(drafting)
        tokens = min(len(lengths) + sum(lengths), top_index)
        more = min(tokens + still, top_index)
        computed = rows_to_compute(self._computed, still) if self._compact else self._computed  # by step t + 1
        cost = self._draft_spent + self._verify[tokens]
        d_cost = self.costs.draft(computed) + self._verify[more] - self._verify[tokens]
        pays = d_gain * cost > self._gain * d_cost
        if pays:
            self._computed = computed
        if t == 0 and not pays and any(drafting) and len(top) >= HOLD_MIN_ROWS:
            self._hold.start(len(top))
        return pays

    def finish_round(self) -> None:
        """The round's drafts wait for verification, to grade the estimates made for them."""
        self._graded = dict(zip(self._req_ids, zip(self._features, self._preds)))

    def end_round(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        """Per request: drafts verified and drafts accepted (labels as in `OnlineAcceptanceEstimator`)."""
        first = self._first
        first[0], first[1] = first[0] + sum(a > 0 for a in accepted), first[1] + len(accepted)
        if first[1] > FIRST_WINDOW:  # the rate follows the workload
            first[0], first[1] = first[0] / 2, first[1] / 2
        if self.estimator is None:
            return
        rows = [(*self._graded[r], a, d) for r, d, a in zip(req_ids, drafted, accepted) if r in self._graded]
        if rows:
            self.estimator.observe_rows(rows)
        self._graded = {}
        self._rounds += 1
        if self._rounds % self.refit_interval == 0:
            self.estimator.refit()
        if self.meter is not None and self._rounds % COST_REFRESH_ROUNDS == 0 and self.meter.samples > self._metered:
            self.costs, self._metered = StepCosts(self.meter.curves()), self.meter.samples

    def forget(self, req_id: str) -> None:
        self._graded.pop(req_id, None)
