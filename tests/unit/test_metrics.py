"""Metric definitions and the greedy simulators on hand-made sequences."""

from __future__ import annotations

import pytest

from vllm_adaptive_spec.metrics import modeled_speedup, simulate_greedy, simulate_workload

T, F = True, False


def test_fixed_k_by_hand():
    match = [T, T, F, T, T, T, T, F]
    c = simulate_greedy(match, k=3)
    # prefill: token 0, no drafts; at 1: 3 drafts, run 1 -> emit 2 (1..2); at 3: 3 drafts, run 4 capped
    # at 3 -> emit 4 (3..6); at 7: the last token, nothing left to draft (max_tokens) -> emit 1
    assert (c.n_target, c.n_draft, c.n_accepted) == (4, 6, 4)
    assert c.accepted_hist == {0: 2, 1: 1, 3: 1}
    assert c.accepted_per_pos == [2, 1, 1]
    assert c.mean_acceptance_length == pytest.approx(8 / 4)
    assert c.discard_rate == pytest.approx(2 / 8)


def test_prefill_pass_verifies_no_drafts():
    # Regression: the replay let the prefill pass verify drafts of token 0 (about 1.5% optimistic).
    # A response whose draft agrees everywhere still pays the prefill pass on its own.
    assert simulate_greedy([T], k=4).n_target == 1
    assert simulate_greedy([T, T], k=4).n_target == 2
    assert simulate_greedy([T] * 5, k=4, oracle=True).n_target == 2


def test_never_drafts_past_max_tokens():
    # Regression: vLLM's fixed-K counters count drafts accepted past max_tokens; the replay caps each
    # round at the tokens the request can still accept, as the plugin does.
    c = simulate_greedy([T] * 6, k=16)
    assert (c.n_target, c.n_draft, c.n_accepted) == (2, 4, 4)


def test_oracle_discards_nothing_and_needs_no_more_steps():
    match = [T, T, F, T, T, T, T, F, F, T]
    for k in (1, 2, 4, 8):
        fixed, oracle = simulate_greedy(match, k), simulate_greedy(match, k, oracle=True)
        assert oracle.n_target == fixed.n_target
        assert oracle.n_draft == oracle.n_accepted == fixed.n_accepted
        assert oracle.discard_rate == 0


def test_all_match_and_none_match():
    assert simulate_greedy([T] * 9, k=2).n_target == 4  # prefill, then runs of 2, 2 and the last 1
    none = simulate_greedy([F] * 5, k=4)
    assert (none.n_target, none.n_accepted, none.n_draft) == (5, 0, 3 + 2 + 1)


def test_workload_sums_and_speedup():
    w = simulate_workload([[T, F], [T, T, T]], k=2)
    # [T, F]: prefill, then the last token alone; [T, T, T]: prefill, then accept 1 and emit 2
    assert (w.n_gen, w.n_target, w.n_accepted, w.n_draft) == (5, 4, 1, 1)
    # modeled speedup: no drafts, one step per token -> 1.0
    assert modeled_speedup(10, 10, 0, c=4) == pytest.approx(1.0)
    assert modeled_speedup(10, 5, 10, c=2) == pytest.approx(1 / (0.5 + 0.5))


def test_draft_lengths_from_per_position_counts():
    from vllm_adaptive_spec.integration.prometheus import lengths_from_per_pos

    # three drafts of lengths 1, 3, 3 -> position counts [3, 2, 2, 0]
    assert lengths_from_per_pos([3, 2, 2, 0]) == {1: 1, 3: 2}
    assert lengths_from_per_pos([0, 0]) == {}


def test_chain_runs_and_replay_from_unrolled_runs():
    from vllm_adaptive_spec.metrics import chain_runs

    assert chain_runs([T, T, F, T]) == [2, 1, 0, 1]
    match = [T, T, F, T, T, F]
    assert simulate_greedy(match, k=4, runs=chain_runs(match)) == simulate_greedy(match, k=4)
    # An EAGLE head unrolled from position 1 may agree on 3 tokens even where its
    # teacher-forced prediction at position 2 would not: the replay follows the runs.
    runs = [0, 3, 0, 0, 0, 0]
    c = simulate_greedy(match, k=4, oracle=True, runs=runs)
    assert (c.n_target, c.n_accepted, c.n_draft) == (3, 3, 3)  # prefill; 1 + 3 drafts (pos 1-4); pos 5


def test_overlapped_speedup_by_hand():
    """PEARL with ideal overlap: 160 tokens in 100 steps, 4 drafts per step. At c = 4 the draft's
    4/4 of a target pass hides behind it (S = tau = 1.6); at c = 2 it takes 2 passes (S = 0.8)."""
    from vllm_adaptive_spec.metrics import overlapped_speedup

    assert overlapped_speedup(160, 100, 400, 4.0) == pytest.approx(1.6)
    assert overlapped_speedup(160, 100, 400, 2.0) == pytest.approx(0.8)
    assert overlapped_speedup(160, 100, 400, 8.0) == pytest.approx(1.6)
    # 40 of the 400 drafted while the target waited: 360 beside it (0.9 of a pass), 40/4 = 10 passes after
    assert overlapped_speedup(160, 100, 400, 4.0, n_sequential=40) == pytest.approx(160 / (100 + 10))
