"""SpecDec++ (seed 001): stop once the head says a rejection has become likely.

The head reads h_t, the draft's final hidden state at the position consuming
y_t. The proposer hands the policy, at draft step t, the hidden state of the
forward that produced q_t, i.e. the one consuming y_{t-1}; so at step t >= 1
the policy learns p_{t-1}, updates the running product, and if
1 - prod_{j<=t-1} p_j > threshold drops y_t and stops: "stop after y_{t-1}"
without an extra draft forward. At t = 0 there is nothing to judge yet.
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.heads.cuda_graph import RowGraphs
from vllm_adaptive_spec.heads.specdecpp import check_specdecpp, load_specdecpp, stop_rule
from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy, finite_rows
from vllm_adaptive_spec.policies.params import Param

FIELD = "adaptive_spec.head"


class SpecDecPPPolicy(StopPolicy):
    name = "specdecpp"
    PARAMS = {"head": Param(str, required=True), "threshold": Param(float, 0.0, 1.0)}

    def __init__(self, head: str, threshold: float | None = None):
        self.head, self.meta = load_specdecpp(head, FIELD)  # float32, CPU until the first round
        self.threshold = float(self.meta["recommended_threshold"] if threshold is None else threshold)
        self._running: torch.Tensor | None = None  # [B] prod of p_j over this round's judged drafts
        self._prob = None  # hidden [B, H] -> p [B], the head's inference forward on self.device
        self._prob_of: torch.nn.Module | None = None  # the head _prob was built from
        self._built_for: torch.device | None = None  # the device _prob was built for

    @classmethod
    def check_engine(cls, params: dict, draft_model: str) -> None:
        check_specdecpp(params["head"], draft_model, FIELD)

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        # The device as set, not the weights' (a tensor reads "cuda:0" where "cuda" may have been set:
        # comparing those rebuilt the forward every round).
        if self._prob_of is not self.head or self._built_for != self.device:
            self._prob, self._prob_of, self._built_for = self._build(), self.head, self.device
        self._running = torch.ones(len(req_ids), dtype=torch.float32, device=self.device)
        return [cap] * len(req_ids)

    def _build(self):
        """hidden [B, H] (the draft's dtype) -> p [B] float32: the head's forward on self.device."""
        if self.device.type != "cuda":
            logits = self.head.to(self.device, torch.float32).inference()
            return lambda hidden: torch.sigmoid(logits(hidden.float()))
        # On a GPU the head costs its kernel launches and, at a draft's width, its float32 weights: at
        # 4096 on an H100 it took 140-250 us a step eagerly, 91 (batch 1) to 191 (batch 32) from a
        # float32 CUDA graph, 65-71 from a bfloat16 one (benchmarks/results/gpu_costs_h100). The draft's
        # hidden states are bfloat16 already; p is float32 for the running product.
        logits = self.head.to(self.device, torch.bfloat16).inference()
        # decide reads p before the next call overwrites the graph's output
        return RowGraphs(
            lambda x: torch.sigmoid(logits(x).float()), self.head.cfg.hidden_size, torch.bfloat16, self.device
        )

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        ok = finite_rows(logp)  # [B]
        no_stop = self.no_stop(ok)  # "drop y_t and stop" is keep = False alone
        if t == 0 or hidden is None:
            return StepDecision(keep=ok, stop=no_stop)
        p = self._prob(hidden)  # [B] p_{t-1}
        self._running, go = stop_rule(self._running, p, self.threshold)
        return StepDecision(keep=ok & go, stop=no_stop)
