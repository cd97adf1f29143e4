"""Measured cost curves (adaptive_spec.costs = "online"): the meter's points on hand-computed cases,
the gate's refresh, and the config's checks."""

from __future__ import annotations

import pytest

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies.batch_gate import COST_REFRESH_ROUNDS, BatchGate
from vllm_adaptive_spec.policies.costs import DEFAULT_COSTS, CostMeter

# draft step 1 ms at 1 row, 2 ms at 32; a pass 2 ms over 1 token, 10 ms over 101
PRIOR = {"draft_step_ms": [[1, 1.0], [32, 2.0]], "verify_ms": [[1, 2.0], [101, 10.0]]}


def test_no_samples_keep_the_prior():
    assert CostMeter(PRIOR).curves() == PRIOR


def test_measured_buckets_replace_the_prior_and_scale_it_elsewhere():
    """Passes over 3 tokens measured at 1.0, 1.1, 9.0 (a stray slow step), 1.2 ms: upper median 1.2 ms,
    against the prior's 2.16 there (2 + 8 * 2 / 100): ratio 1.2 / 2.16; the prior's points outside
    the data keep their shape at that scale. No draft step was measured: the draft curve takes the
    same ratio."""
    meter = CostMeter(PRIOR)
    for ms in (1.0, 1.1, 9.0, 1.2):
        meter.add("verify_ms", 3, ms)
    ratio = 1.2 / 2.16
    got = meter.curves()
    assert got["verify_ms"][1] == [3.0, 1.2]
    assert got["verify_ms"][0] == pytest.approx([1, 2.0 * ratio])
    assert got["verify_ms"][2] == pytest.approx([101, 10.0 * ratio])
    assert [y for _, y in got["draft_step_ms"]] == pytest.approx([ratio, 2.0 * ratio])


def test_a_bucket_needs_min_samples_and_keeps_the_last_window():
    meter = CostMeter(PRIOR, window=4, min_samples=4)
    for _ in range(3):
        meter.add("draft_step_ms", 2, 0.5)
    assert meter.measured("draft_step_ms") == []
    for ms in (0.5, 0.7, 0.7, 0.7):  # the window keeps the last 4: 0.5, 0.7, 0.7, 0.7
        meter.add("draft_step_ms", 2, ms)
    assert meter.measured("draft_step_ms") == [[2.0, 0.7]]
    # the prior points inside the measured range give way; each curve scales by its own ratio
    meter.add("verify_ms", 1, 1.0)  # one sample: no point yet
    assert meter.curves()["draft_step_ms"][0] == pytest.approx([1, 0.7 / (1 + 1 / 31)])


def test_sizes_share_a_bucket_only_when_close():
    meter = CostMeter(PRIOR, min_samples=1)
    for size in (16, 17, 18, 64, 66):
        meter.add("verify_ms", size, 1.0)
    assert [x for x, _ in meter.measured("verify_ms")] == [16.0, 17.5, 65.0]
    meter.add("verify_ms", 0, 1.0)  # below one token, or not a finite time: ignored
    meter.add("verify_ms", 4, float("nan"))
    assert meter.samples == 5


def test_online_gate_rebuilds_its_curves_every_refresh():
    gate = BatchGate(DEFAULT_COSTS, online=True)
    gate.start_round(["a"], 4)
    for _ in range(8):
        gate.meter.add("verify_ms", 1, 1.0)
        gate.meter.add("draft_step_ms", 1, 0.25)
    for i in range(COST_REFRESH_ROUNDS):
        assert gate.costs.curves is DEFAULT_COSTS, i
        gate.end_round([], [], [])
    assert gate.costs.draft(1) == pytest.approx(0.25) and gate.costs.verify_list(1)[1] == pytest.approx(1.0)
    assert BatchGate(DEFAULT_COSTS).meter is None  # a cost file or the bundled curves: fixed


def test_online_costs_config():
    cfg = AdaptiveSpecConfig.from_dict({"policy": "svip", "costs": "online"})
    gate = cfg.build_gate()
    assert gate is not None and gate.meter is not None and gate.costs.curves == DEFAULT_COSTS
    for raw in (
        {"policy": "svip", "costs": "online", "batch_aware": False},
        {"policy": "fixed", "costs": "online"},  # the gate is off for fixed unless asked for
        {"policy": "vllm_av", "costs": "online"},
    ):
        with pytest.raises(ConfigError, match=r"^adaptive_spec.costs: 'online' measures costs for the batch gate"):
            AdaptiveSpecConfig.from_dict(raw)
    assert AdaptiveSpecConfig.from_dict({"policy": "fixed", "batch_aware": True, "costs": "online"}).online_costs


def test_a_slow_bucket_below_fast_ones_is_pooled_not_carried_forward():
    """Passes over 30 tokens measured slower (6.0 ms) than over 32 (4.4 ms): the two pool to their
    weighted mean (4 and 12 samples: 4.8 ms), where a running maximum would price 30 to 38 tokens alike."""
    meter = CostMeter(PRIOR, min_samples=1)
    for size, ms, n in ((2, 2.0, 4), (30, 6.0, 4), (32, 4.4, 12), (40, 6.0, 4)):
        for _ in range(n):
            meter.add("verify_ms", size, ms)
    got = meter.measured("verify_ms")
    assert [x for x, _ in got] == [2, 30, 32, 40] and [y for _, y in got] == pytest.approx([2.0, 4.8, 4.8, 6.0])
