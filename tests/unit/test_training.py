"""SpecDec++ training pieces on tiny hand-made tensors: loss, labels, token mixing, fitting, replay."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_adaptive_spec.metrics import simulate_greedy
from vllm_adaptive_spec.training.data import greedy_labels, mix_tokens, sampling_labels
from vllm_adaptive_spec.training.specdecpp import (
    TrainConfig,
    binary_kl,
    calibration_table,
    evaluate,
    fit_head,
    replay_greedy,
    weighted_bce,
)


def test_weighted_bce_by_hand():
    logits = torch.tensor([0.0, math.log(3.0)])  # p = 0.5, 0.75
    a = torch.tensor([1.0, 0.0])
    # -(log 0.5 + 6 log 0.25) / (1 + 6)
    assert weighted_bce(logits, a, 6.0).item() == pytest.approx((math.log(2) + 6 * math.log(4)) / 7)
    # soft label 0.5 at p = 0.5: -(6*0.5 log 0.5 + 0.5 log 0.5) / (3 + 0.5) = log 2
    assert weighted_bce(torch.zeros(1), torch.tensor([0.5]), 6.0).item() == pytest.approx(math.log(2))
    # w = 1 is the plain mean BCE
    plain = torch.nn.functional.binary_cross_entropy_with_logits(logits, a)
    assert weighted_bce(logits, a, 1.0).item() == pytest.approx(plain.item())


def test_binary_kl_and_calibration():
    p = torch.tensor([0.5, 0.2, 0.95])
    assert binary_kl(p, p).item() == pytest.approx(0.0, abs=1e-6)
    assert binary_kl(torch.tensor([0.5]), torch.tensor([1.0])).item() == pytest.approx(math.log(2))
    assert binary_kl(torch.tensor([0.5]), torch.tensor([0.0])).item() == pytest.approx(math.log(2))
    table = calibration_table(torch.tensor([0.05, 0.07, 0.55, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0]))
    assert [r["count"] for r in table] == [2, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert table[0] == {"bin": "0.0-0.1", "predicted": 0.06, "observed": 0.5, "count": 2}
    assert table[1]["predicted"] is None


def test_greedy_labels():
    q = torch.log(torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]]))
    p = torch.log(torch.tensor([[0.2, 0.6, 0.2], [0.1, 0.1, 0.8]]))
    z, a = greedy_labels(q, p)
    assert z.tolist() == [1, 0] and a.tolist() == [1.0, 0.0]


def test_sampling_labels():
    q = torch.log(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))
    p = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]))
    z, a = sampling_labels(q, p, torch.Generator().manual_seed(0))
    assert z.tolist() == [1, 2, 0]
    assert a.tolist() == pytest.approx([0.25, 0.5, 1.0])  # min(1, p(z) / q(z))
    # in expectation the label is the acceptance rate sum_v min(p, q) = 1 - TV(p, q)
    n = 20000
    q = torch.log(torch.tensor([[0.5, 0.5, 0.0]])).expand(n, 3)
    p = torch.log(torch.tensor([[0.9, 0.1, 0.0]])).expand(n, 3)
    z, a = sampling_labels(q, p, torch.Generator().manual_seed(0))
    assert set(z.tolist()) == {0, 1}
    assert a.mean().item() == pytest.approx(0.6, abs=0.02)


def test_token_mixing():
    y = torch.arange(20000)
    z = -torch.arange(20000) - 1
    gen = torch.Generator().manual_seed(0)
    inputs, holds_z = mix_tokens(y, z, 0.15, gen)
    assert torch.equal(inputs[holds_z], z[holds_z]) and torch.equal(inputs[~holds_z], y[~holds_z])
    assert holds_z.float().mean().item() == pytest.approx(0.85, abs=0.01)
    assert mix_tokens(y, z, 0.0)[1].all() and not mix_tokens(y, z, 1.0)[1].any()


@pytest.fixture
def one_thread():
    """Tiny matmuls: threads only add synchronisation (costly on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_few_epochs_fit_synthetic_acceptance(one_thread):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=gen)
    a = torch.sigmoid(3 * x[:, 0] - x[:, 1])  # soft labels a simple head can learn
    cfg = TrainConfig(depth=2, epochs=15, batch_size=128, lr=3e-3, weight=6.0)
    before = evaluate(fit_head(x, a, TrainConfig(depth=2, epochs=0), progress=False)[0], x, a, cfg.weight)
    head, history = fit_head(x, a, cfg, progress=False)
    after = evaluate(head, x, a, cfg.weight)
    assert len(history) == 15 and history[-1]["weighted_bce"] < history[0]["weighted_bce"]
    assert after["weighted_bce"] < before["weighted_bce"]
    assert after["binary_kl"] < 0.6 * before["binary_kl"]
    # w = 6 pulls predictions down on purpose (rejections cost more); w = 1 calibrates
    calibrated = evaluate(
        fit_head(x, a, TrainConfig(depth=2, epochs=15, batch_size=128, lr=3e-3, weight=1.0), False)[0], x, a, 1.0
    )
    assert calibrated["binary_kl"] < 0.1 * before["binary_kl"]
    assert calibrated["mean_predicted"] == pytest.approx(calibrated["mean_label"], abs=0.03)


def test_replay_without_stopping_is_fixed_k():
    match = [True, True, False, True, True, True, True, False, True, True, True, False]
    ones = [1.0] * len(match)
    branch = {j: [1.0] * 3 for j, m in enumerate(match) if not m}
    got = replay_greedy(match, ones, branch, k=4, threshold=0.5)
    want = simulate_greedy(match, 4)
    assert (got.n_gen, got.n_target, got.n_accepted) == (want.n_gen, want.n_target, want.n_accepted)
    assert got.n_draft <= want.n_draft  # the replay never drafts past the response's end


def test_replay_stops_on_risk():
    # position 0 is the prefill's token (no drafts); the draft's wrong token at 3 and its rollout get 0.1
    match = [True, True, True, False, True, True, True]
    p_clean = [0.95, 0.95, 0.95, None, 0.95, 0.95, 0.95]
    branch = {3: [0.1, 0.1, 0.1]}
    got = replay_greedy(match, p_clean, branch, k=4, threshold=0.3)
    # round at 1: risks 0.05, 0.0975, then 1 - 0.9025 * 0.1 > 0.3 -> stop after 3 drafts, accept 2
    # round at 4: limit min(4, 7 - 1 - 4) = 2: drafts 2 (never judged past the cap), accepts 2
    assert (got.n_target, got.n_draft, got.n_accepted, got.n_gen) == (3, 5, 4, 7)
    # every risk above the threshold after one token: one draft per round, none at the last token
    flat = replay_greedy(match, [0.5] * 7, {3: [0.5] * 3}, k=4, threshold=0.3)
    assert (flat.n_target, flat.n_draft) == (5, 3)
