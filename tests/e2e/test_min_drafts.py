"""adaptive_spec.min_drafts through real vLLM: a rule that would stop every row after its first draft
(confidence at threshold 1.0: no draft is that sure) drafts at least the floor, the batch gate on, and
stays lossless, alone and under a context tail; a floor above the cap K fails at start-up naming the
field (and so does a context tail, adaptive_spec.context_tail: test_context_tail.py)."""

from __future__ import annotations

import pytest

from tests.conftest import (
    MIXED_MAX_TOKENS,
    K,
    close_llm,
    first_mismatch,
    greedy,
    lossless_stats,
    make_llm,
    released_stats,
    spec_config,
)

pytestmark = pytest.mark.e2e
FLOOR = 3


def test_a_floor_of_drafts_is_lossless_and_drafted(lossless_prompts, lossless_reference):
    cfg = {"policy": "confidence", "threshold": 1.0, "min_drafts": FLOOR}  # the gate at its default (on)
    llm = make_llm(speculative_config=spec_config(), additional_config={"adaptive_spec": cfg})
    try:
        got = greedy(llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
        assert got == lossless_reference, first_mismatch(got, lossless_reference)
        one = greedy(llm, lossless_prompts[3:4], MIXED_MAX_TOKENS[3])  # a lone request: the gate decides too
        assert one == lossless_reference[3:4], first_mismatch(one, lossless_reference[3:])
        (snap,) = released_stats(llm)
    finally:
        close_llm(llm)
    hist = {int(k): n for k, n in snap["drafted_len_hist"].items()}
    # shorter drafts only where max_tokens left no room for the floor (requests of 1 or 3 tokens, ends)
    assert hist.get(FLOOR, 0) > 3 * sum(n for k, n in hist.items() if k < FLOOR), hist
    assert max(hist) == FLOOR, hist  # ... and the rule stopped every row there


def test_a_floor_under_a_context_tail_is_lossless(lossless_prompts, lossless_reference):
    """The floor and the tail together on the EAGLE-3 head (the regime rows "..., context tail 4, min n
    drafts"): every round with room drafts the floor, the tail follows it, nothing above the cap."""
    from benchmarks.vllm_run import spec_config as drafter_config

    floor, tail = 2, 2
    cfg = {"policy": "confidence", "threshold": 1.0, "min_drafts": floor, "context_tail": tail}
    snap = lossless_stats(drafter_config(K, "eagle3"), cfg, lossless_prompts, lossless_reference)
    drafted = {int(k): n for k, n in snap["drafted_len_hist"].items()}
    sent = {int(k): n for k, n in snap["proposed_len_hist"].items()}
    assert max(drafted) == floor and drafted[floor] > 3 * sum(n for k, n in drafted.items() if k < floor), drafted
    assert snap["tail_tokens"] > 20 and max(sent) <= floor + tail, (snap["tail_tokens"], sent)


@pytest.mark.parametrize("field", ["min_drafts", "context_tail"])
def test_a_floor_or_tail_above_the_cap_fails_at_startup(field):
    from vllm_adaptive_spec import ConfigError
    from vllm_adaptive_spec.integration.hooks import check_engine_config

    class Spec:
        method = "draft_model"
        model = "unused"
        num_speculative_tokens = 4
        draft_model_config = None

    class Engine:
        additional_config = {"adaptive_spec": {"policy": "copy", field: 5}}
        speculative_config = Spec()

    with pytest.raises(ConfigError) as err:
        check_engine_config(Engine())
    assert str(err.value).startswith(f"adaptive_spec.{field}: 5 is above speculative_config.num_speculative_tokens")
