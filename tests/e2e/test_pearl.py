"""PEARL's parallel mode (policy `pearl`) in real vLLM: lossless at batch 1, drafting on its own
thread and CPU, refusing what it does not serve at start-up."""

from __future__ import annotations

import pytest

from tests.conftest import MIXED_MAX_TOKENS, close_llm, first_mismatch, greedy, make_llm, released_stats, spec_config

pytestmark = pytest.mark.e2e

PEARL = {"adaptive_spec": {"policy": "pearl"}}


@pytest.fixture(scope="module")
def pearl_llm(engine_processes):
    """In an engine-core process of its own, as users run it: vLLM binds that process to its CPUs and
    the draft takes the others (an engine in the test process leaves the process on all of them)."""
    llm = make_llm(speculative_config=spec_config(3), additional_config=PEARL, max_num_seqs=1)
    yield llm
    close_llm(llm)


def test_pearl_is_lossless_at_batch_1(pearl_llm, lossless_prompts, lossless_reference):
    """50 held-out prompts, mixed max_tokens (1 to 64: some requests end inside a draft)."""
    got = greedy(pearl_llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
    assert got == lossless_reference, first_mismatch(got, lossless_reference)


def test_pearl_drafts_on_its_thread_and_reports_its_timeline(pearl_llm, lossless_prompts):
    import os

    greedy(pearl_llm, lossless_prompts[:4])
    (snap,) = released_stats(pearl_llm)
    w, par = snap["workload"], snap["parallel"]
    assert snap["policy"] == "pearl"
    assert set(snap["forwards_per_step"]) == {0}  # no draft forward in the engine's thread
    assert w["n_accepted"] > 0 and w["n_draft"] > w["n_accepted"]
    assert set(snap["drafted_len_hist"]) <= {0, 1, 2, 3}  # the cap K = 3
    # each job drafts until asked, 1 to K + 1; after a rejection one more draft is made at once (pre_draft 1)
    assert par["steps"] <= w["n_drawn"] <= 5 * par["steps"] and par["pre_drafted"] > 0
    assert par["steps"] > 0 and par["timed_steps"] > 0 and 0 < par["step_ms"] < 1000
    if (os.cpu_count() or 1) > 1:
        assert par["draft_cpus"] and 0 not in par["draft_cpus"]  # vLLM binds the engine to CPU 0 here


def test_pearl_on_a_thread_with_its_own_pre_verify_is_lossless(lossless_prompts, lossless_reference):
    """The thread worker (the GPU design; on CPU it shares the interpreter lock with the engine), with
    PEARL's own pre-verify: after a rejection the next step verifies no draft (pre_draft 0)."""
    thread = {"adaptive_spec": {"policy": "pearl", "draft_worker": "thread", "pre_draft": 0}}
    llm = make_llm(speculative_config=spec_config(4), additional_config=thread, max_num_seqs=1)
    try:
        n = 12
        got = greedy(llm, lossless_prompts[:n], MIXED_MAX_TOKENS[:n])
        (snap,) = released_stats(llm)
    finally:
        close_llm(llm)
    assert got == lossless_reference[:n], first_mismatch(got, lossless_reference[:n])
    assert snap["workload"]["n_accepted"] > 0 and snap["parallel"]["steps"] > 0
    assert snap["parallel"]["pre_drafted"] == 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"speculative_config": spec_config(3), "max_num_seqs": 4}, "serves one request at a time: set max_num_seqs=1"),
        (
            {"speculative_config": spec_config(3) | {"method": "eagle3"}, "max_num_seqs": 1},
            "needs speculative_config.method='draft_model', got 'eagle3'",
        ),
        (
            {"speculative_config": spec_config(3), "max_num_seqs": 1, "tensor_parallel_size": 2},
            "tensor_parallel_size=2 and pipeline_parallel_size=1 are not supported",
        ),
    ],
)
def test_pearl_refuses_what_it_does_not_serve_at_startup(kwargs, needle):
    from benchmarks.paths import DRAFTERS
    from vllm_adaptive_spec import ConfigError

    if kwargs["speculative_config"]["method"] == "eagle3":
        kwargs["speculative_config"]["model"] = str(DRAFTERS["eagle3"])
    with pytest.raises(ConfigError) as err:
        make_llm(additional_config=PEARL, **kwargs)
    assert needle in str(err.value)
