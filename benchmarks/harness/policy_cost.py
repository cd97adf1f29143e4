"""The stopping policy's own time per draft step, measured the same way for every policy.

A round at batch 1 on the toy draft's sizes: `round_limits`, the first pass's
context for policies that keep it (Pacer: a 64-token prompt, then 3 verified
tokens a round, as in vLLM), then `decide` for draft steps 0..3 (the
distribution included). The figure is
the round's time divided by its 4 draft steps. Run in one process, after the
workers, so every policy is timed under the same conditions.
"""

from __future__ import annotations

import time

import torch

STEPS = 4


def policy_cost_s(adaptive: dict, vocab: int, hidden_size: int, rounds: int = 300) -> float:
    from vllm_adaptive_spec.config import AdaptiveSpecConfig
    from vllm_adaptive_spec.integration.proposer import policy_logprobs

    torch.manual_seed(0)
    policy = AdaptiveSpecConfig.from_dict(adaptive).build_policy()
    logits, hidden = torch.randn(1, vocab), torch.randn(1, hidden_size)
    tokens = logits.argmax(-1)
    pos = [0]

    def one_round() -> None:
        policy.round_limits(["r"], 16)
        if policy.observes_context:  # the round's first pass: the first round reads a 64-token prompt, later ones 3
            n = 64 if pos[0] == 0 else 3
            policy.observe_context(["r"], torch.randn(n, hidden_size), [0], [n], [pos[0]])
            pos[0] += n
        for t in range(STEPS):
            policy.decide(policy_logprobs(logits, None), tokens, t, hidden)

    for _ in range(20):
        one_round()
    start = time.perf_counter()
    for _ in range(rounds):
        one_round()
    return (time.perf_counter() - start) / rounds / STEPS
