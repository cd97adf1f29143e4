"""The context tail (policies/tail.py): what a request's context predicts after a round's drafts."""

from __future__ import annotations

import torch

from vllm_adaptive_spec.policies.tail import WINDOW, ContextTail, TailGate, with_tail_probs


def tail_of(tokens: list[int], m: int = 8) -> ContextTail:
    t = ContextTail(m)
    t.observe_tokens(["r"], [tokens])
    return t


def test_the_tokens_after_the_last_occurrence_of_the_context_end():
    t = tail_of([1, 2, 3, 4, 1, 2])  # (1, 2) was followed by 3, 4, 1, 2
    assert t.predicts("r")
    assert t.tail("r", [], 3) == [3, 4, 1]
    assert t.tail("r", [], 1) == [3]


def test_the_most_recent_occurrence_and_the_longest_match_win():
    assert tail_of([1, 2, 9, 1, 2, 8, 1, 2]).tail("r", [], 2) == [8, 1]  # (1, 2) last followed by 8
    # (3, 1, 2) matches three tokens at its occurrence before 7; (1, 2) alone last led to 8
    assert tail_of([3, 1, 2, 7, 4, 1, 2, 8, 3, 1, 2]).tail("r", [], 1) == [7]


def test_drafts_extend_the_context_and_a_repeat_runs_on_into_them():
    t = tail_of([5, 6, 7, 5, 6])
    assert t.tail("r", [7], 3) == [5, 6, 7]  # (5, 6, 7) ended at token 2; then 5, 6, then the draft 7
    assert t.tail("r", [], 5) == [7, 5, 6]  # (5, 6) ended at token 1: what followed, to the context's end
    assert t.tail("r", [9, 9], 4) == []  # (6, 9, 9), (9, 9): never seen


def test_nothing_without_a_match_room_or_history():
    t = tail_of([1, 2, 3, 4])
    assert not t.predicts("r") and t.tail("r", [], 4) == []  # the context's end never occurred before
    assert tail_of([1, 2, 1, 2]).tail("r", [], 0) == []
    assert ContextTail(4).tail("unknown", [1, 2], 4) == [] and not ContextTail(4).predicts("unknown")


def test_fed_incrementally_and_bounded_by_its_length():
    t = ContextTail(2)
    t.observe_tokens(["a", "b"], [[1, 2, 3], [4]])
    t.observe_tokens(["a"], [[1, 2]])  # a's output so far: its context is 1 2 3 1 2
    assert t.tokens_seen("a") == 5 and t.tokens_seen("b") == 1 and t.num_tracked() == 2
    assert t.tail("a", [], 10) == [3, 1]  # max_tokens 2
    t.forget("a")
    assert t.num_tracked() == 1 and t.tokens_seen("a") == 0


def test_tail_positions_get_one_hot_draft_probabilities():
    probs = torch.full((2, 2, 5), 0.2)  # [B, T, V] two drawn steps
    # row 0: one draft then a tail of 3 (past the drawn steps); row 1: two drafts, no tail
    got = with_tail_probs(probs.clone(), [[4, 1, 2, 3], [0, 1]], [1, 2])
    assert got.shape == (2, 4, 5)
    assert torch.equal(got[0, 0], probs[0, 0]) and torch.equal(got[1], torch.cat([probs[1], torch.zeros(2, 5)]))
    assert torch.equal(got[0, 1:].argmax(-1), torch.tensor([1, 2, 3])) and torch.equal(
        got[0, 1:].sum(-1), torch.ones(3)
    )
    assert torch.equal(got[0, 1:].amax(-1), torch.ones(3))
    assert with_tail_probs(probs.clone(), [[4], [0]], [1, 1]).shape == (2, 2, 5)  # no tail: as drawn


def test_the_tail_gate_counts_what_the_target_reached_and_accepted():
    gate = TailGate(3)  # priors: drafts 1 of 2, each tail position 1 of 2
    gate.learn([2, 2, 0], [3, 3, 2], [3, 1, 2])
    # row 0: both drafts kept, tail positions 0 (kept) and 1 (rejected) reached; row 1: its second draft
    # rejected, its tail never reached; row 2: no drafts, its whole tail of 2 reached and kept
    assert gate.drafts == [1.0 + 2 + 1, 2.0 + 2 + 2]
    assert gate.reached == [2.0 + 2, 2.0 + 2, 2.0] and gate.accepted == [1.0 + 2, 1.0 + 1, 1.0]
    # a long run's counts halve past WINDOW trials, so the rates follow the workload
    for _ in range(WINDOW):
        gate.learn([1], [1], [0])  # the draft rejected: its tail never reached
    assert gate.drafts[1] <= WINDOW and gate.drafts[0] / gate.drafts[1] < 0.01


def test_the_tail_gate_keeps_the_length_with_the_most_output_per_time():
    gate = TailGate(2)  # tail positions accepted half the time (the prior); one row with no drafts
    # a pass costs the same over any number of tokens (a GPU at batch 1): the whole tail pays
    assert gate.length([0], [2], 1.0, [0.0, 10.0, 10.0, 10.0]) == 2
    # each token costs as much as the pass: none pays (1 / 11 > 1.5 / 21 > 1.75 / 31)
    assert gate.length([0], [2], 1.0, [0.0, 10.0, 20.0, 30.0]) == 0
    # the first tail token pays (1.5 / 13 > 1 / 11), the second does not (1.75 / 31)
    assert gate.length([0], [2], 1.0, [0.0, 10.0, 12.0, 30.0]) == 1
    # a row's drafts come first: its tail counts only if they all survive (a = 1/2: reach 1/4)
    # G(0) = 1 + 1/2 + 1/4 over V(3) = 11 + 1; G(1) adds 1/8 over V(4) + 1
    assert gate.length([2], [1], 1.0, [0.0, 0.0, 0.0, 11.0, 11.5]) == 1  # 1.875 / 12.5 > 1.75 / 12
    assert gate.length([2], [1], 1.0, [0.0, 0.0, 0.0, 11.0, 12.0]) == 0  # 1.875 / 13 < 1.75 / 12
    assert gate.length([1, 1], [0, 0], 1.0, [0.0] * 5) == 0  # no tail to keep
