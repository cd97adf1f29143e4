"""The batch gate: whether another draft step pays for the batch, on hand-computed cases; its config."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies.acceptance import (
    FADE,
    INIT_BIAS,
    INIT_SLOPE,
    MAX_LOG_ODDS,
    MAX_SLOPE,
    AcceptanceTracker,
    BinnedAcceptanceEstimator,
)
from vllm_adaptive_spec.policies.batch_gate import BatchGate, draft_top

# a draft step costs 1 ms at any batch size; a pass over x tokens costs 2 + 0.5 x ms
COSTS = {"draft_step_ms": [[1, 1.0], [64, 1.0]], "verify_ms": [[1, 2.5], [101, 52.5]]}


def _top(q_max: float) -> float:
    """log q_max of one row, what the loop hands the gate (draft_top, copied to the host)."""
    return math.log(q_max)


def _gate(n: int, cap: int = 4, slope: float = 1.0, intercept: float = 0.0) -> BatchGate:
    gate = BatchGate(COSTS)
    gate.start_round([f"r{i}" for i in range(n)], cap)
    est = gate.estimator
    est.slope, est.intercepts = slope, torch.full((cap + 1,), intercept, dtype=torch.float64)
    return gate


def test_hand_computed_step_decision():
    """One row, V(x) = 2 + 0.5 x, D = 1. q_max = 0.9 at step 0: f = log 9, p = sigmoid(log 9) = 0.9
    (slope 1, intercept 0). After step 0: G = 1 + 0.9 = 1.9, C = D + V(2) = 4 -> 0.475 tokens/ms.
    Step 1 adds dG = 0.9 * 0.9 = 0.81 at dC = D + V(3) - V(2) = 1.5 -> 0.54 tokens/ms: it pays."""
    gate = _gate(1)
    assert gate.after_step([_top(0.9)], [True], [True], [1], t=0) is True
    assert gate._gain == pytest.approx(1.9, rel=1e-9)
    # q_max 0.8 (p = 0.8): G/C = 1.8 / 4 = 0.45 against dG/dC = 0.64 / 1.5 = 0.427: stop
    gate = _gate(1)
    assert gate.after_step([_top(0.8)], [True], [True], [1], t=0) is False


def test_rows_that_stopped_add_nothing_but_still_cost_the_step():
    """16 rows; only one still drafts: its expected token does not pay a draft step of the whole batch."""
    n = 16
    gate = _gate(n)
    top = [_top(0.99)] * n
    drafting = [True] + [False] * (n - 1)
    assert not gate.after_step(top, [True] * n, drafting, [1] * n, t=0)
    # all 16 still drafting, all confident: G/C = 31.84 / 19 = 1.68 < dG/dC = 15.68 / 9 = 1.74, it pays
    gate = _gate(n)
    assert gate.after_step(top, [True] * n, [True] * n, [1] * n, t=0)


def test_gate_stops_at_the_cap_and_on_nan_rows():
    gate = _gate(1, cap=1)
    gate.after_step([_top(0.99)], [True], [True], [1], t=0)
    assert not gate.after_step([_top(0.99)], [True], [True], [2], t=1)  # past cap + 1
    gate = _gate(2)
    pays = gate.after_step([_top(0.9), math.nan], [True, False], [True, False], [1, 0], t=0)
    assert isinstance(pays, bool) and not math.isnan(gate._gain)
    assert gate._features[1] == [-MAX_LOG_ODDS]  # a broken row gets the floor


def test_gate_learns_from_verification_like_vllm_av():
    gate = _gate(2)
    for t in range(3):
        gate.after_step([_top(0.9)] * 2, [True, True], [True, True], [t + 1] * 2, t)
    gate.finish_round()
    gate.end_round(["r0", "r1"], [3, 3], [3, 0])
    assert gate.estimator.seen.sum(dim=1).tolist()[:4] == [2, 1, 1, 0]  # r1 rejected at 0: later unseen
    assert gate.estimator.accepted.sum(dim=1).tolist()[:4] == [1, 1, 1, 0]
    gate.forget("r0")


def test_host_features_and_grading_match_the_tensor_estimator():
    """The gate's host arithmetic (log_odds, acceptance) equals the tensor path of vllm_av's tracker
    (top_log_odds, predict) on the same round, and its estimator counts the outcomes the tracker observes."""
    top = torch.tensor([[-0.01, -0.3, -2.0], [0.0, -1e-9, math.nan], [-0.7, -0.05, -0.2]])  # [B, T]
    drafted, accepted = [3, 2, 1], [1, 2, 0]
    tensor = AcceptanceTracker(refit_interval=1000)
    tensor.start_round(["a", "b", "c"], cap=4)
    tensor.estimator.slope, tensor.estimator.intercepts = 0.7, torch.tensor([0.3, -0.1, -0.4, 0.2, 0.0]).double()
    for t in range(3):
        tensor.record(top[:, t])
    feats, preds = tensor.finish_round()
    tensor.end_round(["a", "b", "c"], drafted, accepted)
    gate = _gate(3, cap=4, slope=0.7)
    gate.estimator.intercepts = torch.tensor([0.3, -0.1, -0.4, 0.2, 0.0]).double()
    for t in range(3):
        gate.after_step(top[:, t].tolist(), [True] * 3, [True] * 3, [t + 1] * 3, t)
    assert torch.allclose(torch.tensor(gate._features, dtype=torch.float64), feats.double(), atol=1e-5)
    assert torch.allclose(torch.tensor(gate._preds, dtype=torch.float64), preds.double(), atol=1e-6)
    gate.finish_round()
    gate.end_round(["r2", "r0", "r1"], [drafted[2], drafted[0], drafted[1]], [accepted[2], accepted[0], accepted[1]])
    assert gate.estimator.seen.sum(dim=1).tolist() == tensor.estimator.stats[:, 5].tolist()
    # accepted: a at 0; b at 0 and 1 (c rejected at 0)
    assert gate.estimator.accepted.sum(dim=1).tolist() == [2, 1, 0, 0, 0]


def _outcomes(slope: float, intercepts: list[float], n: int, seed: int = 0) -> list:
    """n one-draft-per-position rows drawn from p_k = sigmoid(slope f + b_k), f uniform in [-3, 3]:
    (features, preds, accepted, admitted) as the gate grades them."""
    g = torch.Generator().manual_seed(seed)
    k = len(intercepts)
    rows = []
    for _ in range(n):
        f = (torch.rand(k, generator=g) * 6 - 3).tolist()
        accepted = k
        for t in range(k):
            if torch.rand(1, generator=g).item() >= 1 / (1 + math.exp(-(slope * f[t] + intercepts[t]))):
                accepted = t
                break
        rows.append((f, [0.5] * k, accepted, k))
    return rows


def test_binned_estimator_recovers_a_known_model():
    est = BinnedAcceptanceEstimator(4)
    rows = _outcomes(1.2, [1.0, 0.5, 0.0, -0.5], 4000)
    est.observe_rows(rows)
    est.refit()
    assert est.slope == pytest.approx(1.2, abs=0.1)
    assert est.intercepts.tolist() == pytest.approx([1.0, 0.5, 0.0, -0.5], abs=0.15)
    assert est.acceptance(0.0, 0) == pytest.approx(1 / (1 + math.exp(-est.intercepts[0].item())))
    assert est.seen.sum().item() == pytest.approx(FADE * sum(min(a + 1, 4) for *_, a, _ in rows))  # faded


def test_binned_estimator_stays_finite_on_separable_outcomes_and_fills_unseen_positions():
    """Every confident draft accepted, every unsure one rejected (separable): unclamped Newton steps ran
    the slope to 10^4 on the replay. A position never observed takes the one before it."""
    est = BinnedAcceptanceEstimator(5)
    rows = [([3.0, 3.0], [0.5, 0.5], 2, 2)] * 50 + [([-3.0], [0.5], 0, 1)] * 50
    est.observe_rows(rows)
    est.refit()
    assert 0.0 <= est.slope <= MAX_SLOPE and torch.isfinite(est.intercepts).all()
    assert est.acceptance(3.0, 0) > 0.9 and est.acceptance(-3.0, 0) < 0.1
    assert est.intercepts[2:].tolist() == [est.intercepts[1].item()] * 3


def test_binned_estimator_without_outcomes_keeps_the_cold_start():
    est = BinnedAcceptanceEstimator(3)
    est.refit()
    assert est.slope == INIT_SLOPE and est.intercepts.tolist() == [INIT_BIAS] * 3


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


def test_one_step_verdict_holds_for_the_next_rounds_of_at_least_as_many_rows():
    """Once the rule ends a round after step 0 while rows still wanted to draft, the next
    HOLD_ROUNDS - 1 rounds of >= as many rows are one-step rounds without the gate; a smaller batch
    (where a second step may pay) or the end of the hold gives the gate back."""
    from vllm_adaptive_spec.policies.batch_gate import HOLD_ROUNDS

    n = 16
    gate = _gate(n)
    assert not gate.one_step_round(n)
    assert not gate.after_step([_top(0.99)] * n, [True] * n, [True] + [False] * (n - 1), [1] * n, t=0)
    assert [gate.one_step_round(n + 1) for _ in range(HOLD_ROUNDS - 1)] == [True] * (HOLD_ROUNDS - 1)
    assert not gate.one_step_round(n) and gate.held_rounds == HOLD_ROUNDS - 1
    # a smaller batch ends the hold at once
    gate.start_round([f"r{i}" for i in range(n)], 4)
    gate.after_step([_top(0.99)] * n, [True] * n, [True] + [False] * (n - 1), [1] * n, t=0)
    assert not gate.one_step_round(n - 1) and not gate.one_step_round(n)


def test_a_hold_covers_the_next_rounds_of_at_least_as_many_rows():
    """The bookkeeping both verdicts share (one step without the gate, no draft at all)."""
    from vllm_adaptive_spec.policies.batch_gate import HOLD_ROUNDS, Hold

    hold = Hold()
    assert not hold.covers(8)  # no verdict yet
    hold.start(8)
    assert [hold.covers(9) for _ in range(HOLD_ROUNDS)] == [True] * (HOLD_ROUNDS - 1) + [False]
    hold.start(8)
    assert not hold.covers(7) and not hold.covers(8)  # a smaller round ends it


def test_no_hold_when_the_step_pays_or_no_row_was_drafting():
    n = 16
    gate = _gate(n)
    assert gate.after_step([_top(0.99)] * n, [True] * n, [True] * n, [1] * n, t=0)  # it pays
    assert not gate.one_step_round(n)
    gate = _gate(n)
    assert not gate.after_step([_top(0.99)] * n, [True] * n, [False] * n, [1] * n, t=0)  # the policy stopped all
    assert not gate.one_step_round(n)


def test_no_hold_below_the_minimum_batch():
    """With one row the verdict follows that row's confidence: the next round gets the gate again."""
    gate = _gate(1)
    assert not gate.after_step([_top(0.8)], [True], [True], [1], t=0)  # as in the hand-computed case
    assert not gate.one_step_round(1)


def test_no_draft_verdict_on_hand_computed_costs_holds_then_probes():
    """Before a round, from earlier rounds only: with D = 1 and V(x) = 2 + 0.5 x, 32 rows verify no draft
    when n (D + V(n + m)) >= (n + m a) (D + V(n)), i.e. 32 x 35 = 1120 >= (32 + 32 a) x 19: a <= 0.842.
    At the prior a = 1/2 that holds; at 4 rows (4 x 7 = 28 against (4 + 4 a) x 5: a <= 0.4) it does not.
    A verdict holds for HOLD_ROUNDS rounds of at least as many rows, then one round drafts (a probe)."""
    from vllm_adaptive_spec.policies.batch_gate import HOLD_ROUNDS

    gate = BatchGate(COSTS)
    assert not gate.no_draft_round(4, 4) and not gate.no_draft_round(32, 0)  # nothing to drop
    assert [gate.no_draft_round(32, 32) for _ in range(HOLD_ROUNDS)] == [True] * HOLD_ROUNDS
    assert not gate.no_draft_round(32, 32)  # the probe
    assert gate.no_draft_round(40, 40) and not gate.no_draft_round(4, 4)  # a smaller batch ends the hold
    assert gate.none_rounds == HOLD_ROUNDS + 1
    # first drafts accepted 9 times in 10: a = (1 + 9 k) / (2 + 10 k) -> 0.9 > 0.842, so 32 rows draft again
    ids = [f"r{i}" for i in range(10)]
    for _ in range(50):
        gate.end_round(ids, [2] * 10, [0] + [1] * 9)
    assert gate._first[0] / gate._first[1] > 0.89
    assert not gate.no_draft_round(32, 32)
    # ... and at 0.8 they do not
    gate = BatchGate(COSTS)
    for _ in range(50):
        gate.end_round(ids, [2] * 10, [0, 0] + [2] * 8)
    assert gate.no_draft_round(32, 32)


def test_no_draft_verdict_counts_the_first_pass_a_draft_model_skips():
    """With skip_share s the round without drafts costs (1 - s) D + V(n): a draft model skips the first pass
    of every other such round (s = 1/2). D = 1, V(x) = 2 + 0.5 x, 32 rows: no draft when
    1120 >= (32 + 32 a) (0.5 + 18), i.e. a <= 0.892 (against a <= 0.842 with s = 0). At a = 0.87 the
    first pass decides the verdict."""
    ids = [f"r{i}" for i in range(100)]
    gates = [BatchGate(COSTS), BatchGate(COSTS)]
    for gate in gates:
        for _ in range(50):
            gate.end_round(ids, [2] * 100, [1] * 87 + [0] * 13)
        assert abs(gate._first[0] / gate._first[1] - 0.87) < 0.002
    assert not gates[0].no_draft_round(32, 32, skip_share=0.0)
    assert gates[1].no_draft_round(32, 32, skip_share=0.5)
