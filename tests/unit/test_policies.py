"""Stopping policies on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_adaptive_spec.policies import POLICY_CLASSES, entropy
from vllm_adaptive_spec.policies.adaedl import AdaEdlPolicy
from vllm_adaptive_spec.policies.confidence import ConfidencePolicy
from vllm_adaptive_spec.policies.heuristic import HeuristicPolicy
from vllm_adaptive_spec.policies.svip import SvipPolicy

V = 8
PEAKED = torch.tensor([0.97] + [0.03 / (V - 1)] * (V - 1))  # H ~ 0.16 nats
FLAT = torch.full((V,), 1.0 / V)  # H = log 8 ~ 2.08 nats
BAD = torch.full((V,), float("nan"))


def batch(*rows):
    return torch.stack(rows)  # [B, V]


def test_entropy():
    assert entropy(batch(FLAT)).item() == pytest.approx(math.log(V))
    assert entropy(batch(torch.eye(V)[0])).item() == pytest.approx(0.0, abs=1e-6)


def test_svip_keeps_token_and_stops_when_uncertain():
    d = SvipPolicy(threshold=0.3).decide(batch(PEAKED, FLAT), torch.tensor([0, 0]), t=0)
    assert d.keep.tolist() == [True, True]
    assert d.stop.tolist() == [False, True]


def test_confidence_uses_sampled_token_probability():
    d = ConfidencePolicy(0.4).decide(batch(PEAKED, PEAKED), torch.tensor([0, 3]), t=0)
    assert d.keep.tolist() == [True, True]
    assert d.stop.tolist() == [False, True]


def test_adaedl_drops_uncertain_token_and_adapts_lambda():
    p = AdaEdlPolicy(lam=0.5)
    p.round_limits(["a", "b"], cap=8)
    d = p.decide(batch(PEAKED, FLAT), torch.tensor([0, 0]), t=0)
    assert d.keep.tolist() == [True, False]
    assert d.stop.tolist() == [False, True]
    p.end_round(["a"], drafted=[4], accepted=[0])  # AR falls below 0.9 -> lam rises
    assert p._state["a"][0] > 0.5
    p.forget("a")
    assert p.num_tracked() == 0


def test_heuristic_schedule():
    p = HeuristicPolicy(initial=4)
    assert p.round_limits(["r"], cap=16) == [4]
    p.end_round(["r"], [4], [4])
    assert p.round_limits(["r"], cap=16) == [6]
    p.end_round(["r"], [6], [2])
    assert p.round_limits(["r"], cap=5) == [5]
    p.end_round(["r"], [5], [0])
    p.end_round(["r"], [4], [0])
    assert p.round_limits(["r"], cap=16) == [3]
    p.forget("r")
    assert p.num_tracked() == 0


@pytest.mark.parametrize("name", sorted(POLICY_CLASSES))
def test_nan_rows_stop_without_crashing(name):
    p = POLICY_CLASSES[name]()
    p.round_limits(["a", "b"], cap=4)
    d = p.decide(batch(PEAKED, BAD), torch.tensor([0, 0]), t=0)
    assert d.stop[1] and not d.keep[1]
