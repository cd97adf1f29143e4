"""adaptive_spec.context_tail through real vLLM: the tokens a request's context predicts, appended after
the drafter's drafts, keep greedy output equal to no speculation's (batched, mixed lengths, and alone),
on an independent draft model, an EAGLE-3 head and a DFlash block drafter; the tail fires and
verification accepts some of it. (Sampling: test_sampling_lossless.py; a tail above the cap K fails
start-up: test_min_drafts.py.)"""

from __future__ import annotations

import pytest

from benchmarks.vllm_run import spec_config
from tests.conftest import (
    MIXED_MAX_TOKENS,
    K,
    close_llm,
    first_mismatch,
    greedy,
    lossless_stats,
    make_llm,
    released_stats,
    steep_costs,
)

pytestmark = pytest.mark.e2e
TAIL = 3
DRAFTERS = [("draft_model", "copy"), ("eagle3", "confidence"), ("dflash", "confidence")]


@pytest.mark.parametrize("method,policy", DRAFTERS)
def test_a_context_tail_is_lossless_and_accepted(method, policy, lossless_prompts, lossless_reference):
    cfg = {"policy": policy, "context_tail": TAIL}  # the gate at its default (on)
    llm = make_llm(speculative_config=spec_config(K, method), additional_config={"adaptive_spec": cfg})
    try:
        got = greedy(llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
        assert got == lossless_reference, first_mismatch(got, lossless_reference)
        one = greedy(llm, lossless_prompts[3:4], MIXED_MAX_TOKENS[3])  # a lone request
        assert one == lossless_reference[3:4], first_mismatch(one, lossless_reference[3:])
        (snap,) = released_stats(llm)
    finally:
        close_llm(llm)
    work = snap["workload"]
    # the tail fired, and verification accepted more than the drafter alone could have: rounds that
    # predicted their next token drafted one token, so accepted drafts past one per round are the tail's
    assert snap["tail_tokens"] > 100, snap["tail_tokens"]
    assert work["n_draft"] > snap["tail_tokens"] and work["n_accepted"] > 0, work
    assert max(int(k) for k in snap["drafted_len_hist"]) <= K
    # what each round sent to verification: its drafts and its tail, every round counted once
    sent, drafted = snap["proposed_len_hist"], snap["drafted_len_hist"]
    assert sum(sent.values()) == sum(drafted.values()), (sent, drafted)
    total = sum(int(k) * n for k, n in sent.items())
    assert total == sum(int(k) * n for k, n in drafted.items()) + snap["tail_tokens"], (sent, drafted)
    assert max(int(k) for k in sent) <= K  # the tail stays under the cap


def test_the_tail_gate_cuts_tails_that_cost_more_than_they_add(tmp_path, lossless_prompts, lossless_reference):
    """With the batch gate on (confidence's default), a tail token is kept only where its expected
    acceptance pays for its verification (policies/tail.py: TailGate). On curves where every verified
    token costs as much as a pass over one, none does: every tail is cut, and output stays the target's;
    with `tail_gate` off the same engine appends them."""
    steep = steep_costs(tmp_path)
    tails = {}
    for gated in (True, False):
        cfg = {"policy": "confidence", "context_tail": TAIL, "costs": steep, "tail_gate": gated}
        snap = lossless_stats(spec_config(K, "draft_model"), cfg, lossless_prompts, lossless_reference)
        tails[gated] = snap["tail_tokens"], snap["tail_cut"]
    # gated: everything offered was cut (and counted as cut); ungated: appended, nothing counted as cut
    assert tails[True][0] == 0 and tails[True][1] > 50 and tails[False][0] > 50 and tails[False][1] == 0, tails
