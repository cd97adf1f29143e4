"""vllm_av (vLLM's adaptive verification, our implementation): the feature, slot admission, the
budget rule, the online estimator against a dense Newton solve, cost curves and cost files."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.unit.test_policies import stops
from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies import acceptance as vllm_av
from vllm_adaptive_spec.policies.acceptance import OnlineAcceptanceEstimator, max_log_odds, survival
from vllm_adaptive_spec.policies.costs import curve
from vllm_adaptive_spec.policies.vllm_av import VllmAvPolicy, admit, choose_budget


def test_feature_is_the_log_odds_of_the_most_likely_token():
    q = torch.tensor([[0.5, 0.25, 0.25], [0.8, 0.1, 0.1], [1.0, 0.0, 0.0]])
    f = max_log_odds(q.log())
    assert f[0].item() == pytest.approx(0.0, abs=1e-6)
    assert f[1].item() == pytest.approx(math.log(4.0), abs=1e-5)
    assert f[2].item() == vllm_av.MAX_LOG_ODDS  # one-hot: clamped, not inf


def test_admission_takes_the_global_best_slots_as_prefixes():
    surv = survival(torch.tensor([[0.9, 0.5 / 0.9], [0.8, 0.7 / 0.8]]))  # [[0.9, 0.5], [0.8, 0.7]]
    assert torch.allclose(surv, torch.tensor([[0.9, 0.5], [0.8, 0.7]]))
    cap = torch.tensor([2, 2])
    assert admit(surv, cap, torch.tensor(3)).tolist() == [1, 2]  # 0.9, 0.8, 0.7
    assert admit(surv, cap, torch.tensor(1)).tolist() == [1, 0]
    assert admit(surv, cap, torch.tensor(0)).tolist() == [0, 0]
    assert admit(surv, cap, torch.tensor(4)).tolist() == [2, 2]
    # slots past a row's capacity are never admitted, whatever the budget
    assert admit(surv, torch.tensor([1, 2]), torch.tensor(4)).tolist() == [1, 2]


def test_budget_maximises_expected_tokens_per_cost():
    # one request; drafts survive with 0.9, 0.5, 0.1; draft costs 1, a pass over 1 + b tokens 1 + 0.2 b
    scores = torch.tensor([0.9, 0.5, 0.1])
    verify = torch.tensor([1.0, 1.2, 1.4, 1.6])
    # b=0: 1/2, b=1: 1.9/2.2, b=2: 2.4/2.4, b=3: 2.5/2.6 -> 2
    assert choose_budget(scores, 1, 1.0, verify).item() == 2
    # verification free of charge: everything that can add a token is admitted
    assert choose_budget(scores, 1, 1.0, torch.ones(4)).item() == 3
    # very expensive extra tokens: nothing
    assert choose_budget(scores, 1, 1.0, torch.tensor([1.0, 10.0, 20.0, 30.0])).item() == 0


def _dense_newton(est: OnlineAcceptanceEstimator, feats, preds, accepted, admitted) -> torch.Tensor:
    """Reference: theta = [slope, intercepts] + (X^T W X + L2 I)^-1 X^T (y - p) over the observed slots."""
    k = est.k
    rows, w, r = [], [], []
    for i in range(feats.shape[0]):
        for t in range(feats.shape[1]):
            if t <= accepted[i] and t < admitted[i]:
                x = torch.zeros(1 + k, dtype=torch.float64)
                x[0], x[1 + t] = feats[i, t], 1.0
                p = float(preds[i, t])
                rows.append(x), w.append(p * (1 - p)), r.append((1.0 if t < accepted[i] else 0.0) - p)
    x = torch.stack(rows)
    hess = x.T @ torch.diag(torch.tensor(w, dtype=torch.float64)) @ x + vllm_av.L2 * torch.eye(
        1 + k, dtype=torch.float64
    )
    step = torch.linalg.solve(hess, x.T @ torch.tensor(r, dtype=torch.float64))
    return torch.cat([torch.tensor([est.slope], dtype=torch.float64), est.intercepts]) + step


def test_estimator_refit_is_the_newton_step(monkeypatch):
    monkeypatch.setattr(vllm_av, "DAMPING", 0.0)  # undamped: exactly the arrowhead system's solution
    gen = torch.Generator().manual_seed(0)
    est = OnlineAcceptanceEstimator(4)
    feats = torch.randn(6, 4, generator=gen, dtype=torch.float64) * 2
    preds = est.predict(feats)
    accepted = torch.tensor([0, 1, 4, 2, 3, 0])
    admitted = torch.tensor([3, 4, 4, 2, 4, 1])  # row 3: all admitted accepted; rows 0, 5: first rejected
    want = _dense_newton(est, feats, preds, accepted, admitted)
    est.observe(feats, preds, accepted, admitted)
    assert est.stats[:, 5].tolist() == [6, 4, 2, 2]  # observed slots per position
    est.refit()
    got = torch.cat([torch.tensor([est.slope], dtype=torch.float64), est.intercepts])
    assert torch.allclose(got, want, atol=1e-9), (got, want)
    assert est.stats.abs().sum() == 0  # the round's statistics are cleared


def test_estimator_learns_acceptance_from_outcomes():
    """Drafts accepted exactly when their feature is positive: the fit separates the two."""
    gen = torch.Generator().manual_seed(1)
    est = OnlineAcceptanceEstimator(3)
    for _ in range(30):
        feats = torch.randn(32, 3, generator=gen, dtype=torch.float64) * 3
        ok = feats > 0
        accepted = torch.where(ok.all(dim=1), 3, (~ok).int().argmax(dim=1))
        est.observe(feats, est.predict(feats), accepted, torch.full((32,), 3))
        est.refit()
    p = est.predict(torch.tensor([[4.0, 4.0, 4.0], [-4.0, -4.0, -4.0]], dtype=torch.float64))
    assert (p[0] > 0.8).all() and (p[1] < 0.2).all(), p


def test_policy_drafts_everything_then_admits_a_prefix_per_row():
    policy = VllmAvPolicy()
    ids = ["a", "b", "c"]
    assert policy.round_limits(ids, 4) == [4, 4, 4]
    gen = torch.Generator().manual_seed(2)
    for t in range(4):
        logp = torch.log_softmax(torch.randn(3, 20, generator=gen) * 3, dim=-1)
        d = policy.decide(logp, logp.argmax(-1), t)
        assert d.keep.all() and not d.stop.any()  # the draft side never stops early
    lengths = torch.tensor([4, 4, 2])
    got = policy.admit(lengths)
    assert ((got >= 0) & (got <= lengths)).all()
    policy.end_round(["a", "b"], [int(got[0]), int(got[1])], [0, 0])
    assert policy.tracker.estimator.stats[:, 5].sum() > 0 or int(got[0]) + int(got[1]) == 0


def test_admission_never_reads_the_drawn_tokens():
    """Same draft distributions, other sampled tokens: the same admission (ALGORITHMS.md's rule)."""
    gen = torch.Generator().manual_seed(3)
    logps = [torch.log_softmax(torch.randn(4, 30, generator=gen) * 2, dim=-1) for _ in range(3)]
    results = []
    for tokens in (lambda lp: lp.argmax(-1), lambda lp: torch.zeros(4, dtype=torch.long)):
        policy = VllmAvPolicy()
        policy.round_limits(["a", "b", "c", "d"], 3)
        for t, lp in enumerate(logps):
            policy.decide(lp, tokens(lp), t)
        results.append(policy.admit(torch.tensor([3, 3, 3, 1])).tolist())
    assert results[0] == results[1]


def test_nan_rows_stop_and_are_not_admitted():
    policy = VllmAvPolicy()
    policy.round_limits(["a", "b"], 2)
    logp = torch.log_softmax(torch.randn(2, 10), dim=-1)
    logp[1] = float("nan")
    d = policy.decide(logp, logp.argmax(-1), 0)
    assert d.keep.tolist() == [True, False] and stops(d) == [False, True]


def test_cost_curve_interpolates_and_extrapolates():
    pts = [[1, 2.0], [9, 4.0]]
    got = curve(pts, torch.tensor([1, 5, 9, 17, 0]))
    assert torch.allclose(got, torch.tensor([2.0, 3.0, 4.0, 6.0, 2.0], dtype=torch.float64))
    assert torch.allclose(curve([[4, 3.0]], torch.tensor([1, 100])), torch.tensor([3.0, 3.0], dtype=torch.float64))


def test_cost_file_is_validated_at_start_up(tmp_path):
    good = tmp_path / "costs.json"
    good.write_text(json.dumps({"draft_step_ms": [[1, 0.5]], "verify_ms": [[1, 2.0], [64, 6.0]]}))
    cfg = AdaptiveSpecConfig.from_dict({"policy": "vllm_av", "costs": str(good)})
    assert cfg.build_policy().costs.curves["verify_ms"][1] == [64.0, 6.0]
    for name, doc in (
        ("bad", {"verify_ms": [[1, 2.0]]}),
        ("negative", {"draft_step_ms": [[1, -1.0]], "verify_ms": [[1, 2.0]]}),
    ):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match="adaptive_spec.costs"):
            AdaptiveSpecConfig.from_dict({"policy": "vllm_av", "costs": str(path)})
    with pytest.raises(ConfigError, match="adaptive_spec.costs"):
        AdaptiveSpecConfig.from_dict({"policy": "svip", "costs": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match="adaptive_spec.refit_interval"):
        AdaptiveSpecConfig.from_dict({"policy": "vllm_av", "refit_interval": 0})


def test_tracker_grades_each_request_by_id_in_any_order():
    """end_round gathers the round's rows by request id (one index op): requests may come back in
    another order or not at all (finished or preempted), and each is graded on its own features."""
    from vllm_adaptive_spec.policies.acceptance import AcceptanceTracker

    def graded(order: list[str], drafted: list[int], accepted: list[int]) -> torch.Tensor:
        tracker = AcceptanceTracker(refit_interval=1000)
        tracker.start_round(["a", "b", "c"], cap=2)
        for top in ([0.9, 0.5, 0.2], [0.8, 0.4, 0.1]):
            tracker.record(torch.tensor(top).log())
        tracker.finish_round()
        tracker.forget("c")  # e.g. preempted before verification
        tracker.end_round(order, drafted, accepted)
        return tracker.estimator.stats.clone()

    want = graded(["a", "b"], [2, 2], [2, 0])
    assert torch.equal(graded(["b", "a", "c"], [2, 2, 1], [0, 2, 1]), want)
    assert not torch.equal(graded(["a", "b"], [2, 2], [0, 2]), want)
