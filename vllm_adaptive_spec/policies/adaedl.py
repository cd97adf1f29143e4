"""AdaEDL (Agrawal et al. 2024; from public re-implementations).

Before keeping y_t: drop it and stop if 1 - sqrt(g * H_t) < lam, g = 0.2.
lam adapts per request after each round from its acceptance rate:
AR <- b1*AR + (1-b1)*n_acc/n_drafted; lam' = lam + eps if AR < a else
lam - eps; lam <- b2*lam + (1-b2)*lam'.
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy, neg_entropy
from vllm_adaptive_spec.policies.params import Param


class AdaEdlPolicy(StopPolicy):
    name = "adaedl"
    PARAMS = {
        "lam": Param(float, 0.0, 1.0),
        "gamma": Param(float, 1e-6),
        "beta1": Param(float, 0.0, 1.0),
        "beta2": Param(float, 0.0, 1.0),
        "eps": Param(float, 0.0, 1.0),
        "target_ar": Param(float, 0.0, 1.0),
    }

    def __init__(
        self,
        lam: float = 0.5,
        gamma: float = 0.2,
        beta1: float = 0.5,
        beta2: float = 0.9,
        eps: float = 0.01,
        target_ar: float = 0.9,
    ):
        self.lam0, self.gamma = lam, gamma
        self.beta1, self.beta2, self.eps, self.target_ar = beta1, beta2, eps, target_ar
        self._state: dict[str, tuple[float, float]] = {}  # req_id -> (lam, AR)
        self._min_neg_entropy: torch.Tensor | None = None  # [B] this round's bounds on -H

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        lams = [self._state.get(r, (self.lam0, 1.0))[0] for r in req_ids]
        # 1 - sqrt(g * H) >= lam  <=>  H <= (1 - lam)^2 / g  (never, when lam > 1)
        bounds = [(1 - lam) ** 2 / self.gamma if lam <= 1 else -1.0 for lam in lams]
        self._min_neg_entropy = torch.tensor([-b for b in bounds], dtype=torch.float32, device=self.device)
        return [cap] * len(req_ids)

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        keep = neg_entropy(logp) >= self._min_neg_entropy  # [B]; NaN -> False -> drop and stop
        return StepDecision(keep=keep, stop=self.no_stop(keep))

    def end_round(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        for req_id, n_d, n_a in zip(req_ids, drafted, accepted):
            lam, ar = self._state.get(req_id, (self.lam0, 1.0))
            if n_d > 0:
                ar = self.beta1 * ar + (1 - self.beta1) * n_a / n_d
            step = self.eps if ar < self.target_ar else -self.eps
            lam = self.beta2 * lam + (1 - self.beta2) * (lam + step)
            self._state[req_id] = (lam, ar)

    def forget(self, req_id: str) -> None:
        self._state.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._state)
