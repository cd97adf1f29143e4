"""MTP layers through the shared adaptive loop (speculative_config.method = "mtp").

vLLM drafts with most MTP layers through its EagleProposer, so the loop that
serves EAGLE-3 heads serves them unchanged. The toy target has no MTP layer:
these tests build a tiny MiMo checkpoint (benchmarks/toy_pair/mimo_mtp.py, a
Qwen2 decoder plus one MTP layer, random weights) and check: the drafter is
the shared loop; with the fixed policy it drafts what vLLM's own loop drafts
(same passes, same drafts kept); greedy output equals no speculation's on
the 50 held-out prompts, batched and one at a time (every fifth), for every
policy run here; and the MTP drafters vLLM serves some other way are refused
at start-up with one clear error.
"""

from __future__ import annotations

import pytest

from benchmarks.paths import load_prompts
from benchmarks.toy_pair.mimo_mtp import build
from tests.conftest import (
    MIXED_MAX_TOKENS,
    N_LOSSLESS,
    close_llm,
    first_mismatch,
    greedy,
    make_llm,
    released_stats,
    same_work_as_vllm,
)

pytestmark = pytest.mark.e2e

CAP = 4
# policies run on the MTP layer: vLLM's rule, one that reads the entropy (its loop preparing each step
# ahead, as on CUDA), one that reads q_max with the batch gate, and vLLM's adaptive verification
CASES = [
    ("fixed", {}),
    ("svip", {"prepare_ahead": True}),
    ("confidence", {}),
    ("vllm_av", {}),
]


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("mimo-mtp"))


def _llm(mimo_dir, **kwargs):
    return make_llm(model=str(mimo_dir), **kwargs)


def _mtp(k: int = CAP) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}  # the draft is the target's own MTP layer


@pytest.fixture(scope="module")
def mimo_reference(mimo_dir) -> list[list[int]]:
    """The MiMo target's greedy tokens without speculation, on the held-out prompts at mixed lengths."""
    llm = _llm(mimo_dir)
    try:
        return greedy(llm, load_prompts("code_heldout", N_LOSSLESS), MIXED_MAX_TOKENS)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def vllm_mtp_llm(mimo_dir):
    """vLLM's own MTP speculation (plugin installed, not configured), with per-request counts."""
    llm = _llm(mimo_dir, speculative_config=_mtp(), per_request_spec_decode_metrics="summary")
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module", params=CASES, ids=[name for name, _ in CASES])
def mtp_llm(request, mimo_dir):
    policy, extra = request.param
    llm = _llm(mimo_dir, speculative_config=_mtp(), additional_config={"adaptive_spec": {"policy": policy} | extra})
    yield policy, llm
    close_llm(llm)


def _drafter_name(worker) -> str:
    return type(worker.model_runner.drafter).__name__


def test_the_drafter_is_the_shared_loop_and_greedy_output_is_lossless(mtp_llm, vllm_mtp_llm, mimo_reference):
    policy, llm = mtp_llm
    assert llm.collective_rpc(_drafter_name) == ["AdaptiveEagleProposer"]
    assert vllm_mtp_llm.collective_rpc(_drafter_name) == ["EagleProposer"]
    if policy == "fixed":  # vLLM's work: the same passes and drafts kept as vLLM's own MTP loop
        own = same_work_as_vllm(llm, vllm_mtp_llm)
        assert 0 < own["n_accepted"] < own["n_draft"], "the MTP layer is right often, not always"
    prompts = load_prompts("code_heldout", N_LOSSLESS)
    got = greedy(llm, prompts, MIXED_MAX_TOKENS)  # up to 16 running at once
    assert got == mimo_reference, first_mismatch(got, mimo_reference)
    for i in range(0, N_LOSSLESS, 5):  # one request in the engine at a time
        got = greedy(llm, prompts[i : i + 1], MIXED_MAX_TOKENS[i])
        assert got == mimo_reference[i : i + 1], f"prompt {i}: " + first_mismatch(got, mimo_reference[i:])
    (snap,) = released_stats(llm)
    assert snap["policy"] == policy and snap["workload"]["n_accepted"] > 0
    assert max(int(k) for k in snap["drafted_len_hist"]) <= CAP
    assert snap["requests"] == {} and snap["tracked"] == 0, snap


def test_a_head_trained_for_another_drafter_fails_on_an_mtp_engine(mimo_dir):
    """SpecDec++ and Pacer heads are trained for one drafter (their fingerprint): none for MTP yet."""
    from benchmarks.harness.plan import EAGLE3_SPECDECPP_HEAD, PACER_HEAD
    from vllm_adaptive_spec import ConfigError

    for policy, head in (("specdecpp", EAGLE3_SPECDECPP_HEAD), ("pacer", PACER_HEAD)):
        with pytest.raises(ConfigError) as err:
            _llm(
                mimo_dir,
                speculative_config=_mtp(),
                additional_config={"adaptive_spec": {"policy": policy, "head": str(head)}},
            )
        msg = str(err.value)
        assert msg.startswith("adaptive_spec.head: ") and "the running draft is" in msg, msg


class _HfConfig:
    model_type = "qwen2"


class _DraftModelConfig:
    hf_config = _HfConfig()


class _Spec:
    """What check_engine_config reads of vLLM's SpeculativeConfig for method "mtp"."""

    method = "mtp"
    model = "some/mtp-model"
    draft_model_config = _DraftModelConfig()
    own_proposer = ""

    def use_gemma4_mtp(self) -> bool:
        return self.own_proposer == "gemma4_mtp"

    def use_step3p5_mtp(self) -> bool:
        return self.own_proposer == "step3p5_mtp"


class _Engine:
    additional_config = {"adaptive_spec": {"policy": "svip"}}

    def __init__(self, spec: _Spec):
        self.speculative_config = spec


@pytest.mark.parametrize("own_proposer", ["gemma4_mtp", "step3p5_mtp", "index sharing"])
def test_mtp_drafters_with_a_step_of_their_own_fail_at_startup(own_proposer):
    from vllm_adaptive_spec import ConfigError
    from vllm_adaptive_spec.integration.hooks import check_engine_config

    spec = _Spec()
    if own_proposer == "index sharing":
        spec.draft_model_config = type("D", (), {"hf_config": type("H", (), {"index_share_for_mtp_iteration": True})})
    else:
        spec.own_proposer = own_proposer
    with pytest.raises(ConfigError) as err:
        check_engine_config(_Engine(spec))
    msg = str(err.value)
    assert msg.startswith("adaptive_spec does not support this speculative_config.method='mtp' drafter"), msg
    assert ("sparse-attention indices" if own_proposer == "index sharing" else "proposer class of its own") in msg
    assert check_engine_config(_Engine(_Spec())).policy == "svip"  # an MTP layer vLLM's EagleProposer serves
