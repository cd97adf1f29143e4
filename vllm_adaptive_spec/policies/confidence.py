"""confidence (DISCO-like; HF transformers' assistant_confidence_threshold).

After sampling y_t (kept), stop if q_t(y_t) < threshold (default 0.4).
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy, finite_rows
from vllm_adaptive_spec.policies.params import Param


class ConfidencePolicy(StopPolicy):
    name = "confidence"
    PARAMS = {"threshold": Param(float, 0.0, 1.0)}

    def __init__(self, threshold: float = 0.4):
        self.threshold = threshold

    def decide(self, probs: torch.Tensor, tokens: torch.Tensor, t: int) -> StepDecision:
        ok = finite_rows(probs)
        q_tok = probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B]
        return StepDecision(keep=ok, stop=(q_tok < self.threshold) | ~ok)
