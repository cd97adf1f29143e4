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

s_i is the running product of the acceptance estimates of `acceptance.py`
(read off the draft distributions, fitted online from what the target
accepted); p_i(t + 1) is estimated from row i's last distribution with the
intercept of the next position. D(n) and V(x) are the measured cost curves
(`costs.py`). The gate only ever ends a round early, for all rows at once:
every draft it leaves in place was kept by the row's own policy, and the
decision to stop after a kept draft may depend on it (a stopping time,
ALGORITHMS.md), so sampling stays lossless.
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.policies.acceptance import AcceptanceTracker
from vllm_adaptive_spec.policies.costs import StepCosts


def draft_top(logp: torch.Tensor, tokens: torch.Tensor, greedy: bool) -> torch.Tensor:
    """log q_max of each row. logp [B, V], tokens [B] the drawn ones -> [B].

    When every row is greedy its token is the argmax: a gather, not another pass over the vocabulary
    (that pass was most of the gate's cost at batch 32)."""
    if greedy:
        return logp.gather(1, tokens.long().unsqueeze(1)).squeeze(1)
    return logp.amax(dim=-1)


class BatchGate:
    def __init__(self, costs: dict, refit_interval: int = 100):
        self.tracker = AcceptanceTracker(refit_interval)
        self.costs = StepCosts(costs)
        self._surv: torch.Tensor | None = None  # [B] survival of each row's kept drafts
        self._gain: torch.Tensor | None = None  # 0-d expected tokens of the round so far
        self._draft_ms = 0.0
        self._verify: torch.Tensor | None = None  # [n (cap + 1) + 1] pass cost per token count

    def start_round(self, req_ids: list[str], cap: int, device: torch.device) -> None:
        n = len(req_ids)
        self.tracker.start_round(req_ids, cap)
        self._surv = torch.ones(n, dtype=torch.float32, device=device)
        self._gain = torch.tensor(float(n), device=device)
        self._draft_ms = self.costs.draft(n)
        self._verify = self.costs.verify_table(n * (cap + 1), device)

    def after_step(
        self, top: torch.Tensor, kept: torch.Tensor, drafting: torch.Tensor, lengths: torch.Tensor, t: int
    ) -> torch.Tensor:
        """After draft step t: top [B] = log q_max of the step's distributions (`draft_top`), kept [B]
        rows that kept y_t, drafting [B] rows that would draft step t + 1, lengths [B] drafts kept so far.
        Returns a 0-d bool: whether step t + 1 pays for the batch (tensor ops, no host sync)."""
        est = self.tracker.estimator
        f = self.tracker.record(top).unsqueeze(1)  # [B, 1]
        p_now = est.predict(f, first=t)[:, 0]  # [B] acceptance of y_t
        self._surv = torch.where(kept, self._surv * p_now, self._surv)
        self._gain = self._gain + (self._surv * kept).sum()
        if t + 1 >= est.k:
            return torch.zeros((), dtype=torch.bool, device=top.device)
        p_next = est.predict(f, first=t + 1)[:, 0]  # [B] estimated acceptance of y_{t+1}
        d_gain = (self._surv * p_next * drafting).sum()
        n = lengths.shape[0]
        tokens = (n + lengths.sum()).clamp(max=self._verify.shape[0] - 1)
        more = (tokens + drafting.sum()).clamp(max=self._verify.shape[0] - 1)
        cost = (t + 1) * self._draft_ms + self._verify[tokens]
        d_cost = self._draft_ms + self._verify[more] - self._verify[tokens]
        return d_gain * cost > self._gain * d_cost

    def finish_round(self) -> None:
        if self.tracker.features:
            self.tracker.finish_round()

    def end_round(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        self.tracker.end_round(req_ids, drafted, accepted)

    def forget(self, req_id: str) -> None:
        self.tracker.forget(req_id)
