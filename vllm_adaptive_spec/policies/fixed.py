"""fixed: always draft the cap K (vLLM's own behaviour), or `k` tokens under it."""

from __future__ import annotations

from vllm_adaptive_spec.policies.base import StopPolicy
from vllm_adaptive_spec.policies.params import Param


class FixedPolicy(StopPolicy):
    name = "fixed"
    PARAMS = {"k": Param(int, 1, 1024)}

    def __init__(self, k: int | None = None):
        self.k = k  # None: the engine's cap (num_speculative_tokens)

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        return [cap if self.k is None else min(self.k, cap)] * len(req_ids)
