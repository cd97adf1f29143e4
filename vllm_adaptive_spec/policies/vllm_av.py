"""vllm_av: vLLM's adaptive verification, re-implemented as a baseline.

vLLM 0.32's Model Runner V2 (GPU, full CUDA graphs) trims verification per
request (`vllm/v1/worker/gpu/spec_decode/adaptive_verification.py`). The
rule, written here from its description:

1. Draft the full K for every request (the draft side never stops early).
2. Score every (request, position k) slot by its survival, the running
   product of the acceptance estimates of `acceptance.py` (read off the draft
   distributions, never the drawn tokens: lossless under sampling).
3. Admit the globally best B slots (survival falls along a request, so each
   request keeps a prefix), B maximising expected tokens per unit of cost:
       B = argmax_b (n + sum of the b best survivals) / (D(n) + V(n + b))
   with D(n) the round's draft time for n requests (K draft steps) and V(x)
   a target pass over x tokens, from measured cost curves (`costs.py`).
4. Fit the estimator online from what the target accepted.

Where it differs from vLLM's: it runs in the V1 runner's draft loop on any
device (no CUDA graphs, no triton); the cost curves come from a file
measured on the machine (`benchmarks/step_costs.py`), not from a start-up
profile; the budget is chosen on this round's survivals, where vLLM's
host-side budget reads the previous step's copy.
"""

from __future__ import annotations

import math

import torch

from vllm_adaptive_spec.policies.acceptance import AcceptanceTracker, survival
from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy
from vllm_adaptive_spec.policies.costs import DEFAULT_COSTS, StepCosts
from vllm_adaptive_spec.policies.params import Param


def choose_budget(scores: torch.Tensor, n_rows: int, draft_ms: float, verify_ms: torch.Tensor) -> torch.Tensor:
    """B: how many of the sorted (descending) slot scores [M] to verify; verify_ms[j] is the cost of a
    target pass over n_rows + j tokens, j = 0..M ([M + 1]). Returns a 0-d long tensor."""
    gain = n_rows + torch.cat([scores.new_zeros(1), torch.cumsum(scores, dim=0)])  # [M + 1]
    return torch.argmax(gain / (draft_ms + verify_ms))


def admit(surv: torch.Tensor, capacity: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """The globally best `budget` slots by survival -> admitted drafts per row.

    surv: [B, K]; capacity: [B] drafts each row has (slots past it are not eligible); budget: 0-d."""
    steps = torch.arange(surv.shape[1], device=surv.device)
    scores = surv.masked_fill(steps[None, :] >= capacity[:, None], -math.inf).flatten()  # [B*K]
    order = torch.argsort(scores, descending=True)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen[order] = torch.arange(scores.numel(), device=surv.device) < budget
    return (chosen & (scores > -math.inf)).view_as(surv).sum(dim=1)


class VllmAvPolicy(StopPolicy):
    name = "vllm_av"
    PARAMS = {"refit_interval": Param(int, 1, 1_000_000)}
    trims = True  # the proposer calls admit() after the loop
    uses_costs = True  # gets the plugin's cost curves (adaptive_spec.costs)

    def __init__(self, refit_interval: int = 100, costs: dict | None = None):
        self.tracker = AcceptanceTracker(refit_interval)
        self.costs = StepCosts(costs or DEFAULT_COSTS)

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        self.tracker.start_round(req_ids, cap)
        return [cap] * len(req_ids)

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        top = logp.amax(dim=-1)  # [B] log q_max
        ok = torch.isfinite(top)  # rows holding NaN (finite_rows) stop
        self.tracker.record(top)
        return StepDecision(keep=ok, stop=self.no_stop(ok))

    def admit(self, lengths: torch.Tensor) -> torch.Tensor:
        """After the loop: lengths [B] drafts each row holds -> how many of them go to verification."""
        if not self.tracker.features:
            return lengths
        _, preds = self.tracker.finish_round()  # [B, T]
        surv = survival(preds)
        n_rows, steps = surv.shape
        draft_ms = steps * self.costs.draft(n_rows)
        verify_ms = self.costs.verify_table(n_rows * (steps + 1), surv.device)[n_rows:]  # [B*T + 1]
        positions = torch.arange(steps, device=surv.device)
        eligible = surv.masked_fill(positions[None, :] >= lengths[:, None], -1.0).flatten()
        scores = torch.sort(eligible, descending=True).values.clamp_min(0.0)  # [B*T]
        budget = choose_budget(scores, n_rows, draft_ms, verify_ms)
        return torch.minimum(admit(surv, lengths, budget), lengths)

    def end_round(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        self.tracker.end_round(req_ids, drafted, accepted)

    def forget(self, req_id: str) -> None:
        self.tracker.forget(req_id)
