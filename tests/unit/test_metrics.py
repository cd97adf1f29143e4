"""Metric definitions and the greedy simulators on hand-made sequences."""

from __future__ import annotations

import pytest

from vllm_adaptive_spec.metrics import modeled_speedup, simulate_greedy, simulate_workload

T, F = True, False


def test_fixed_k_by_hand():
    # runs: at 0 -> 2 matches then miss; at 3 -> 4 matches (capped at K=3)
    match = [T, T, F, T, T, T, T, F]
    c = simulate_greedy(match, k=3)
    # step 1: accept 2, emit 3 (pos 0..2); step 2 at 3: accept 3, emit 4 (3..6); step 3 at 7: accept 0
    assert (c.n_target, c.n_draft, c.n_accepted) == (3, 9, 5)
    assert c.accepted_hist == {2: 1, 3: 1, 0: 1}
    assert c.accepted_per_pos == [2, 2, 1]
    assert c.mean_acceptance_length == pytest.approx(8 / 3)
    assert c.discard_rate == pytest.approx(4 / 8)


def test_oracle_discards_nothing_and_needs_no_more_steps():
    match = [T, T, F, T, T, T, T, F, F, T]
    for k in (1, 2, 4, 8):
        fixed, oracle = simulate_greedy(match, k), simulate_greedy(match, k, oracle=True)
        assert oracle.n_target == fixed.n_target
        assert oracle.n_draft == oracle.n_accepted == fixed.n_accepted
        assert oracle.discard_rate == 0


def test_all_match_and_none_match():
    assert simulate_greedy([T] * 9, k=2).n_target == 3
    none = simulate_greedy([F] * 5, k=4)
    assert (none.n_target, none.n_accepted, none.n_draft) == (5, 0, 20)


def test_workload_sums_and_speedup():
    w = simulate_workload([[T, F], [T, T, T]], k=2)
    # [T, F]: accept 1, emit 2; [T, T, T]: accept 2, emit 3: one step each
    assert (w.n_gen, w.n_target, w.n_accepted, w.n_draft) == (5, 2, 3, 4)
    # modeled speedup: no drafts, one step per token -> 1.0
    assert modeled_speedup(10, 10, 0, c=4) == pytest.approx(1.0)
    assert modeled_speedup(10, 5, 10, c=2) == pytest.approx(1 / (0.5 + 0.5))


def test_draft_lengths_from_per_position_counts():
    from vllm_adaptive_spec.integration.prometheus import lengths_from_per_pos

    # three drafts of lengths 1, 3, 3 -> position counts [3, 2, 2, 0]
    assert lengths_from_per_pos([3, 2, 2, 0]) == {1: 1, 3: 2}
    assert lengths_from_per_pos([0, 0]) == {}
