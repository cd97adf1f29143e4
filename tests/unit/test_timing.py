"""adaptive_spec.time_policy: the config field and the timing wrapper."""

import pytest
import torch

from vllm_adaptive_spec.config import AdaptiveSpecConfig, ConfigError
from vllm_adaptive_spec.policies.svip import SvipPolicy
from vllm_adaptive_spec.policies.timing import Clock, TimedPolicy
from vllm_adaptive_spec.stats import StatsBook


def test_time_policy_field_is_validated_and_kept_apart_from_policy_params():
    cfg = AdaptiveSpecConfig.from_dict({"policy": "svip", "threshold": 0.5, "time_policy": True})
    assert cfg.time_policy is True and cfg.params == {"threshold": 0.5}
    assert AdaptiveSpecConfig.from_dict({"policy": "svip"}).time_policy is False
    with pytest.raises(ConfigError, match=r"^adaptive_spec.time_policy: expected true or false, got 'yes'$"):
        AdaptiveSpecConfig.from_dict({"policy": "svip", "time_policy": "yes"})


def test_timed_policy_decides_like_the_policy_and_counts_its_calls():
    inner, plain = SvipPolicy(threshold=0.5), SvipPolicy(threshold=0.5)
    clock = Clock()
    timed = TimedPolicy(inner, clock)
    timed.device = torch.device("cpu")
    assert inner.device == torch.device("cpu") and timed.name == "svip" and not timed.observes_context
    logp = torch.log_softmax(torch.randn(3, 50) * torch.tensor([[0.1], [1.0], [10.0]]), dim=-1)
    tokens = logp.argmax(-1)
    assert timed.round_limits(["a", "b", "c"], 8) == plain.round_limits(["a", "b", "c"], 8)
    for t in range(3):
        got, want = timed.decide(logp, tokens, t), plain.decide(logp, tokens, t)
        assert torch.equal(got.keep, want.keep) and torch.equal(got.stop, want.stop)
    timed.end_round(["a"], [3], [1])
    assert clock.rounds == 1 and clock.decides == 3 and clock.policy_s > 0
    clock.propose_s = 3 * clock.policy_s
    d = clock.as_dict()
    assert d["policy_share"] == pytest.approx(0.5, rel=1e-3) and d["policy_us_per_decide"] > 0


def test_stats_snapshot_carries_timing_only_when_on():
    book = StatsBook()
    assert "timing" not in book.snapshot()
    book.clock = Clock()
    assert book.snapshot()["timing"]["policy_share"] is None  # nothing proposed yet


def test_timed_policy_passes_on_every_hook_and_flag_of_a_policy():
    """Regression: the wrapper did not pass on `reads_tokens`/`observe_tokens`, so the harness (which
    times every plugin configuration) ran `copy` with an empty context index: a rule of q alone."""
    from vllm_adaptive_spec.policies.base import StopPolicy
    from vllm_adaptive_spec.policies.copy import CopyPolicy

    helpers = {"no_stop", "check_engine"}  # used inside a policy's own calls / on the class at start-up
    hooks = {n for n, v in vars(StopPolicy).items() if callable(v) and not n.startswith("_")} - helpers
    assert hooks - set(vars(TimedPolicy)) == set()
    flags = {n for n, v in vars(StopPolicy).items() if isinstance(v, bool)}
    timed = TimedPolicy(CopyPolicy(threshold=0.9), Clock())
    assert flags and all(getattr(timed, n) == getattr(timed.inner, n) for n in flags) and timed.reads_tokens
    timed.observe_tokens(["a"], [[5, 6, 7, 5, 6]])
    assert timed.tokens_seen("a") == 5
    timed.round_limits(["a"], 4)
    logp = torch.full((1, 10), -10.0)  # q(y) far below the threshold: only a repeat keeps drafting
    got = timed.decide(logp, torch.tensor([7]), 0)  # (5, 6) was followed by 7
    assert not got.stop.item()
    assert timed.decide(logp, torch.tensor([1]), 1).stop.item()  # (6, 7) -> 5 was seen, 1 was not


def test_clock_adds_the_latest_target_forward_to_each_steady_gap_and_times_garbage_collection():
    import gc

    clock = Clock()
    clock.last_target_s = 0.004
    clock.add_steady_gap(0.010)
    clock.last_target_s = 0.006
    clock.add_steady_gap(0.012)
    assert clock.steady_rounds == 2
    assert clock.steady_gap_s == pytest.approx(0.022) and clock.steady_target_s == pytest.approx(0.010)
    clock.watch_gc()
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(clock._on_gc)
    d = clock.as_dict()
    assert d["gc_runs"] >= 1 and d["gc_s"] > 0 and d["steady_rounds"] == 2
