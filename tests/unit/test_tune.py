"""Threshold tuning by replay (training/tune.py): round lengths of each rule, the replay's counts by
hand, and a sweep that must find the threshold separating agreeing drafts from the first miss."""

from __future__ import annotations

import pytest
import torch

from vllm_adaptive_spec.training.specdecpp_eagle3 import replay_lengths
from vllm_adaptive_spec.training.tune import ChainFeatures, TuneConfig, rule_lengths, stop_lengths, sweep


def test_stop_lengths_include_the_step_that_stops():
    stop = torch.tensor([[False, True, False], [False, False, False], [True, True, True]])
    assert stop_lengths(stop).tolist() == [2, 3, 1]


def test_rule_lengths_read_the_policy_features():
    f = ChainFeatures(
        runs=torch.tensor([0, 0]),
        entropy=torch.tensor([[0.1, 0.7, 0.1], [0.1, 0.1, 0.1]]),  # svip h=0.3: stop once H > 0.6
        q_max=torch.tensor([[0.9, 0.5, 0.3], [0.2, 0.9, 0.9]]),
    )
    assert rule_lengths("svip", 0.3, f).tolist() == [2, 3]
    assert rule_lengths("confidence", 0.4, f).tolist() == [3, 1]
    assert rule_lengths("confidence", 0.6, f).tolist() == [2, 1]


def test_replay_counts_by_hand():
    # 6 generated tokens: the prefill gives token 0; rounds at 1 (accepts 2 of 3), 4 (the cap is the one
    # token left before the end: 0 of 1), 5 (nothing left to draft)
    counts = replay_lengths([torch.tensor([2, 0, 1, 0, 0])], [torch.full((5,), 3)], 3)
    assert (counts.n_gen, counts.n_target, counts.n_draft, counts.n_accepted) == (6, 4, 4, 2)
    assert dict(counts.accepted_hist) == {0: 3, 2: 1}


def test_sweep_finds_the_threshold_that_stops_at_the_first_miss():
    torch.manual_seed(0)
    feats = []
    for _ in range(4):
        runs = torch.randint(0, 6, (40,))
        step = torch.arange(8)[None, :]
        q = torch.where(step < runs[:, None], 0.9, 0.2)  # sure while the chain agrees, unsure at its first miss
        feats.append(ChainFeatures(runs=runs, entropy=torch.zeros(40, 8), q_max=q))
    result = sweep(feats, TuneConfig(cap=8, confidence=(0.1, 0.5, 0.95), svip=(0.3,)))
    best = result["policies"]["confidence"]["best"]
    assert best["threshold"] == 0.5
    assert best["speedup"] > result["best_fixed"]["speedup"]
    assert best["discard_rate"] < result["best_fixed"]["discard_rate"]
    # svip never stops here (zero entropy): it is fixed K = cap
    assert result["policies"]["svip"]["best"]["tau"] == result["fixed"][-1]["tau"]


def test_a_measured_step_curve_prices_each_pass_by_its_length(tmp_path):
    """Passes by drafts verified come from the per-position counts; at a flat curve with a draft at
    t_T / c the priced S is S(c); where each verified draft costs much more, the sweep picks shorter rounds."""
    import json

    counts = replay_lengths([torch.tensor([2, 0, 1, 0, 0])], [torch.full((5,), 3)], 3)
    assert counts.passes_by_drafts() == {0: 2, 3: 1, 1: 1}  # the prefill and the round with nothing left
    assert counts.priced_speedup([10.0] * 5, 10.0 / 4) == pytest.approx(counts.modeled_speedup(4))

    torch.manual_seed(0)
    feats = []
    for _ in range(4):
        runs = torch.randint(0, 6, (40,))
        q = torch.where(torch.arange(8)[None, :] < runs[:, None], 0.9, 0.2) + 0.05 * torch.rand(40, 8)
        feats.append(ChainFeatures(runs=runs, entropy=torch.zeros(40, 8), q_max=q))
    grid = (0.1, 0.5, 0.93, 0.96)
    flat = sweep(feats, TuneConfig(cap=8, confidence=grid, svip=(0.3,)))
    steep = tmp_path / "steep.json"  # every verified token costs 3 passes: drafting rarely pays
    steep.write_text(json.dumps({"draft_step_ms": [[1, 0.1]], "verify_ms": [[1, 1.0], [2, 4.0], [9, 25.0]]}))
    priced = sweep(feats, TuneConfig(cap=8, confidence=grid, svip=(0.3,), costs=str(steep)))
    assert flat["policies"]["confidence"]["best"]["threshold"] == 0.5
    assert priced["policies"]["confidence"]["best"]["threshold"] > 0.5
    assert "speedup_at_c" in priced["best_fixed"] and priced["best_fixed"]["fixed_k"] == 1
