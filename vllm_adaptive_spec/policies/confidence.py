"""confidence (DISCO-like; HF transformers' assistant_confidence_threshold).

After sampling y_t (kept), stop if q_t(y_t) < threshold (default 0.4).
"""

from __future__ import annotations

import math

import torch

from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy
from vllm_adaptive_spec.policies.params import Param


class ConfidencePolicy(StopPolicy):
    name = "confidence"
    PARAMS = {"threshold": Param(float, 0.0, 1.0)}

    def __init__(self, threshold: float = 0.4):
        self.threshold = threshold
        self._log_threshold = math.log(threshold) if threshold > 0 else -math.inf

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        logq = logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B] log q_t(y_t), NaN for bad rows
        return StepDecision(keep=logq == logq, stop=logq < self._log_threshold)  # NaN: not kept
