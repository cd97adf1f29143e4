"""compact_drafts inside vLLM: once at most half of a batch still drafts, the later draft forwards compute
those rows only. The drafts must be exactly those of the whole-batch loop: the same tokens, target passes,
drafts and accepted drafts, on both step drafters, prepared ahead (the CUDA order) or not."""

from __future__ import annotations

import pytest

from benchmarks import vllm_run
from benchmarks.paths import load_prompts
from tests.conftest import close_llm, first_mismatch, greedy, make_llm, released_stats

pytestmark = pytest.mark.e2e

CAP = 8
# confidence without the gate: rows stop one by one, so later forwards have rows to leave out
POLICY = {"policy": "confidence", "batch_aware": False}
SETTINGS = {
    "whole batch": {"compact_drafts": False},
    "compacted": {"compact_drafts": True},
    "compacted, prepared ahead": {"compact_drafts": True, "prepare_ahead": True},
}


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_compacted_forwards_draft_what_the_whole_batch_drafts(method, ref_llm):
    prompts = load_prompts("code_heldout", 32)
    want = greedy(ref_llm, prompts, 48)
    snaps = {}
    for name, setting in SETTINGS.items():
        llm = make_llm(
            speculative_config=vllm_run.spec_config(CAP, method), additional_config={"adaptive_spec": POLICY | setting}
        )
        try:
            got = greedy(llm, prompts, 48)  # up to 16 at once
            assert got == want, f"{name}: " + first_mismatch(got, want)
            (snaps[name],) = released_stats(llm)
        finally:
            close_llm(llm)
    whole = snaps["whole batch"]
    assert whole["compact_drafts"] is False and whole["rows_saved"] == 0
    for name in ("compacted", "compacted, prepared ahead"):
        snap = snaps[name]
        assert snap["compact_drafts"] is True and snap["rows_saved"] > 0, (name, snap["rows_saved"])
        assert snap["workload"] == whole["workload"], name  # passes, drafts, accepted, drawn
        assert snap["forwards_per_step"] == whole["forwards_per_step"], name
        assert snap["drafted_len_hist"] == whole["drafted_len_hist"], name


def test_a_block_drafter_refuses_compaction_at_startup():
    from vllm_adaptive_spec import ConfigError
    from vllm_adaptive_spec.integration.hooks import check_engine_config

    class Spec:
        method = "dflash"
        model = str(vllm_run.DRAFTERS["dflash"])

    class Engine:
        additional_config = {"adaptive_spec": {"policy": "svip", "compact_drafts": True}}
        speculative_config = Spec()

    with pytest.raises(ConfigError) as err:
        check_engine_config(Engine())
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.compact_drafts: true") and "method='dflash'" in msg, msg
    Engine.additional_config = {"adaptive_spec": {"policy": "svip"}}  # the default: nothing to compact, no error
    assert check_engine_config(Engine()).policy == "svip"
