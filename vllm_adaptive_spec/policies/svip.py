"""SVIP (seed 003, Alg. 1): stop once the draft is uncertain.

After sampling y_t (which is kept), stop if sqrt(c_e * H_t) > h. Defaults
from the paper's public code: c_e = 0.15, h = 0.3 (H_t > 0.6 nats).
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy, neg_entropy
from vllm_adaptive_spec.policies.params import Param


class SvipPolicy(StopPolicy):
    name = "svip"
    PARAMS = {"threshold": Param(float, 0.0, 100.0), "entropy_scale": Param(float, 1e-6, 1e6)}

    def __init__(self, threshold: float = 0.3, entropy_scale: float = 0.15):
        self.threshold = threshold
        self.entropy_scale = entropy_scale
        # sqrt(c_e * H) > h  <=>  H > h^2 / c_e  <=>  -H < -h^2 / c_e: one comparison per step
        self._min_neg_entropy = -(threshold**2) / entropy_scale

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        s = neg_entropy(logp)  # [B] -H, NaN for bad rows
        return StepDecision(keep=s == s, stop=s < self._min_neg_entropy)  # NaN: not kept
