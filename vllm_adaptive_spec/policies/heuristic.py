"""heuristic (HF transformers' assisted generation schedule).

Per request: next round's length K' = K + 2 if every draft token was
accepted, else max(1, K - 1); capped at the engine's K.
"""

from __future__ import annotations

from vllm_adaptive_spec.policies.base import StopPolicy
from vllm_adaptive_spec.policies.params import Param


class HeuristicPolicy(StopPolicy):
    name = "heuristic"
    PARAMS = {"initial": Param(int, 1, 1024)}

    def __init__(self, initial: int = 4):
        self.initial = initial
        self._length: dict[str, int] = {}

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        return [min(cap, self._length.get(r, self.initial)) for r in req_ids]

    def end_round(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        for req_id, n_d, n_a in zip(req_ids, drafted, accepted):
            k = self._length.get(req_id, self.initial)
            self._length[req_id] = k + 2 if n_a == n_d else max(1, k - 1)

    def forget(self, req_id: str) -> None:
        self._length.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._length)
