"""The batch gate: whether another draft step pays for the batch, on hand-computed cases; its config."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies.batch_gate import BatchGate, draft_top

# a draft step costs 1 ms at any batch size; a pass over x tokens costs 2 + 0.5 x ms
COSTS = {"draft_step_ms": [[1, 1.0], [64, 1.0]], "verify_ms": [[1, 2.5], [101, 52.5]]}


def _logp(q_max: float, v: int = 5) -> torch.Tensor:
    rest = (1 - q_max) / (v - 1)
    return torch.log(torch.tensor([q_max] + [rest] * (v - 1)))


def _top(q_max: float) -> torch.Tensor:
    """[1] log q_max, what the loop hands the gate (draft_top)."""
    return torch.log(torch.tensor([q_max]))


def _gate(n: int, cap: int = 4, slope: float = 1.0, intercept: float = 0.0) -> BatchGate:
    gate = BatchGate(COSTS)
    gate.start_round([f"r{i}" for i in range(n)], cap, torch.device("cpu"))
    est = gate.tracker.estimator
    est.slope, est.intercepts = slope, torch.full((cap + 1,), intercept, dtype=torch.float64)
    return gate


def test_hand_computed_step_decision():
    """One row, V(x) = 2 + 0.5 x, D = 1. q_max = 0.9 at step 0: f = log 9, p = sigmoid(log 9) = 0.9
    (slope 1, intercept 0). After step 0: G = 1 + 0.9 = 1.9, C = D + V(2) = 4 -> 0.475 tokens/ms.
    Step 1 adds dG = 0.9 * 0.9 = 0.81 at dC = D + V(3) - V(2) = 1.5 -> 0.54 tokens/ms: it pays."""
    gate = _gate(1)
    one = torch.ones(1, dtype=torch.bool)
    pays = gate.after_step(_top(0.9), one, one, torch.tensor([1]), t=0)
    assert bool(pays)
    assert float(gate._gain) == pytest.approx(1.9, rel=1e-5)
    # q_max 0.8 (p = 0.8): G/C = 1.8 / 4 = 0.45 against dG/dC = 0.64 / 1.5 = 0.427: stop
    gate = _gate(1)
    assert not bool(gate.after_step(_top(0.8), one, one, torch.tensor([1]), t=0))


def test_rows_that_stopped_add_nothing_but_still_cost_the_step():
    """16 rows; only one still drafts: its expected token does not pay a draft step of the whole batch."""
    n = 16
    gate = _gate(n)
    logp = _top(0.99).expand(n)
    kept = torch.ones(n, dtype=torch.bool)
    drafting = torch.zeros(n, dtype=torch.bool)
    drafting[0] = True
    assert not bool(gate.after_step(logp, kept, drafting, torch.ones(n, dtype=torch.long), t=0))
    # all 16 still drafting, all confident: G/C = 31.84 / 19 = 1.68 < dG/dC = 15.68 / 9 = 1.74, it pays
    gate = _gate(n)
    assert bool(gate.after_step(logp, kept, kept, torch.ones(n, dtype=torch.long), t=0))


def test_gate_stops_at_the_cap_and_on_nan_rows():
    gate = _gate(1, cap=1)
    one = torch.ones(1, dtype=torch.bool)
    gate.after_step(_top(0.99), one, one, torch.tensor([1]), t=0)
    assert not bool(gate.after_step(_top(0.99), one, one, torch.tensor([2]), t=1))  # past cap + 1
    gate = _gate(2)
    logp = torch.stack([_logp(0.9), torch.full((5,), math.nan)])
    logp = draft_top(logp, logp.nan_to_num(-1e9).argmax(-1), greedy=False)
    pays = gate.after_step(logp, torch.tensor([True, False]), torch.tensor([True, False]), torch.tensor([1, 0]), t=0)
    assert pays.dtype == torch.bool and not torch.isnan(gate._gain)


def test_gate_learns_from_verification_like_vllm_av():
    gate = _gate(2)
    both = torch.ones(2, dtype=torch.bool)
    for t in range(3):
        gate.after_step(_top(0.9).expand(2), both, both, torch.full((2,), t + 1), t)
    gate.finish_round()
    gate.end_round(["r0", "r1"], [3, 3], [3, 0])
    assert gate.tracker.estimator.stats[:, 5].tolist()[:3] == [2, 1, 1]
    gate.forget("r0")


def test_draft_top_gathers_the_greedy_token_and_takes_the_max_when_sampling():
    logp = torch.log_softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), -1)  # [B, V]
    want = logp.amax(-1)
    assert torch.equal(draft_top(logp, logp.argmax(-1), greedy=True), want)
    sampled = torch.zeros(6, dtype=torch.long)  # a sampled token need not be the argmax
    assert torch.equal(draft_top(logp, sampled, greedy=False), want)


def test_batch_aware_config():
    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).batch_aware
    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).build_gate() is not None
    assert not AdaptiveSpecConfig.from_dict({"policy": "svip", "batch_aware": False}).batch_aware
    assert AdaptiveSpecConfig.from_dict({"policy": "svip", "batch_aware": False}).build_gate() is None
    assert not AdaptiveSpecConfig.from_dict({"policy": "fixed"}).batch_aware  # the baselines: off
    assert not AdaptiveSpecConfig.from_dict({"policy": "vllm_av"}).batch_aware
    assert AdaptiveSpecConfig.from_dict({"policy": "fixed", "batch_aware": True}).batch_aware
    with pytest.raises(ConfigError, match="adaptive_spec.batch_aware"):
        AdaptiveSpecConfig.from_dict({"policy": "vllm_av", "batch_aware": True})
    with pytest.raises(ConfigError, match="adaptive_spec.batch_aware"):
        AdaptiveSpecConfig.from_dict({"policy": "svip", "batch_aware": "yes"})
