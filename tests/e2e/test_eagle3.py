"""EAGLE-3 through the shared adaptive loop, with the bundled head for the toy target.

The loop that serves the draft model serves the EAGLE-3 head too (proposer.py:
the head reads the target's fused hidden states in the first pass and its own
last state at every later step). Every training-free policy runs on it in
test_adaptive_policies.py; here: with the fixed policy the loop must draft what
vLLM's own EAGLE loop drafts (same passes, same drafts kept), which checks that
the state carried from step to step is the one vLLM carries; the SpecDec++
head trained on the EAGLE-3 head's own chains; and what is refused at start-up.
"""

from __future__ import annotations

import time

import pytest

from benchmarks import vllm_run
from benchmarks.harness.plan import EAGLE3_SPECDECPP_HEAD, SPECDECPP_HEAD
from benchmarks.paths import load_prompts
from tests.conftest import (
    MAX_TOKENS,
    MIXED_MAX_TOKENS,
    N_LOSSLESS,
    close_llm,
    first_mismatch,
    greedy,
    greedy_params,
    make_llm,
    released_stats,
)

pytestmark = pytest.mark.e2e

CAP = 8


def eagle3_config(k: int = CAP) -> dict:
    return vllm_run.spec_config(k, "eagle3")


def _drafter_name(worker) -> str:
    return type(worker.model_runner.drafter).__name__


@pytest.fixture(scope="module")
def vllm_eagle3_llm():
    """vLLM's own EAGLE-3 speculation (plugin installed, not configured), with per-request counts."""
    llm = make_llm(speculative_config=eagle3_config(), per_request_spec_decode_metrics="summary")
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def eagle3_llm():
    llm = make_llm(speculative_config=eagle3_config(), additional_config={"adaptive_spec": {"policy": "fixed"}})
    yield llm
    close_llm(llm)


def test_the_drafter_is_the_shared_loop_in_front_of_vllms_eagle_proposer(eagle3_llm, vllm_eagle3_llm):
    assert eagle3_llm.collective_rpc(_drafter_name) == ["AdaptiveEagleProposer"]
    assert vllm_eagle3_llm.collective_rpc(_drafter_name) == ["EagleProposer"]


def test_fixed_policy_drafts_what_vllms_eagle_loop_drafts(eagle3_llm, vllm_eagle3_llm):
    """Same work, same K: the same target passes and the same drafts kept, request by request
    summed (counted as tests/e2e/test_exact_counts.py counts them; vLLM's accepted counter
    also counts drafts accepted past max_tokens, which the plugin never drafts)."""
    from benchmarks.harness.worker import _delta, plugin_totals, request_counts

    llm = eagle3_llm
    prompts = load_prompts("code_heldout", N_LOSSLESS + 20)[N_LOSSLESS:]  # neither engine has seen them
    params = greedy_params(MAX_TOKENS)
    outs = vllm_eagle3_llm.generate(prompts, params, use_tqdm=False)
    vllm = request_counts(outs, speculative=True)
    own0 = plugin_totals(llm)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    own = _delta(plugin_totals(llm), own0, 1)
    assert got == [list(o.outputs[0].token_ids) for o in outs]
    assert own["n_accepted"] > 2 * own["n_target"], "the head gets long drafts accepted"
    assert (own["n_gen"], own["n_target"], own["n_accepted"]) == (vllm["n_gen"], vllm["n_target"], vllm["n_accepted"])
    assert own["n_draft"] <= vllm["n_draft"]


@pytest.fixture(scope="module")
def eagle3_specdecpp_llm():
    adaptive = {"policy": "specdecpp", "head": str(EAGLE3_SPECDECPP_HEAD)}
    llm = make_llm(speculative_config=eagle3_config(), additional_config={"adaptive_spec": adaptive})
    yield llm
    close_llm(llm)


def test_specdecpp_head_trained_on_the_eagle3_head(eagle3_specdecpp_llm, lossless_prompts, lossless_reference):
    got = greedy(eagle3_specdecpp_llm, lossless_prompts, MIXED_MAX_TOKENS[: len(lossless_prompts)])
    assert got == lossless_reference, first_mismatch(got, lossless_reference)
    (snap,) = released_stats(eagle3_specdecpp_llm)
    assert snap["workload"]["n_accepted"] > 0
    assert len(snap["drafted_len_hist"]) > 1, "the head stops drafts at varying lengths"
    assert snap["requests"] == {} and snap["tracked"] == 0, snap


@pytest.mark.parametrize("method, head", [("eagle3", SPECDECPP_HEAD), ("draft_model", EAGLE3_SPECDECPP_HEAD)])
def test_a_head_trained_for_one_drafter_fails_on_the_other(method, head):
    from vllm_adaptive_spec import ConfigError

    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        make_llm(
            speculative_config=vllm_run.spec_config(CAP, method),
            additional_config={"adaptive_spec": {"policy": "specdecpp", "head": str(head)}},
        )
    msg = str(err.value)
    assert msg.startswith("adaptive_spec.head: ") and "the running draft is" in msg, msg
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("method, needle", [("dflash", "parallel forward"), ("mtp", "not verified")])
def test_unsupported_drafters_fail_at_startup_with_one_clear_error(method, needle):
    from vllm_adaptive_spec import ConfigError
    from vllm_adaptive_spec.integration.hooks import check_engine_config

    class Spec:
        pass

    class Engine:
        additional_config = {"adaptive_spec": {"policy": "svip"}}
        speculative_config = Spec()

    Engine.speculative_config.method = method
    with pytest.raises(ConfigError) as err:
        check_engine_config(Engine())
    assert f"speculative_config.method={method!r}" in str(err.value) and needle in str(err.value)


def test_every_supported_method_has_a_drafter():
    from vllm_adaptive_spec.integration.hooks import SUPPORTED_METHODS
    from vllm_adaptive_spec.integration.proposer import DRAFTERS

    assert set(DRAFTERS) == set(SUPPORTED_METHODS)
