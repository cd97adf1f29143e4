"""Greedy speculative output equals the target's own greedy output, token for token."""

from __future__ import annotations

import pytest

from tests.conftest import MAX_TOKENS, first_mismatch, greedy

pytestmark = pytest.mark.e2e


def test_reference_is_nontrivial(reference_tokens):
    assert len(reference_tokens) >= 20
    assert sum(len(t) for t in reference_tokens) > 10 * MAX_TOKENS


def test_vllm_draft_model_speculation_is_lossless(spec_llm, prompts, reference_tokens):
    got = greedy(spec_llm, prompts)
    assert got == reference_tokens, first_mismatch(got, reference_tokens)


def test_plugin_on_is_lossless(adaptive_llm, prompts, reference_tokens):
    got = greedy(adaptive_llm, prompts)
    assert got == reference_tokens, first_mismatch(got, reference_tokens)


def test_speculation_actually_ran(adaptive_llm, prompts):
    greedy(adaptive_llm, prompts[:2])
    names = {m.name for m in adaptive_llm.get_metrics()}
    assert "vllm:spec_decode_num_draft_tokens" in names
    drafted = sum(m.value for m in adaptive_llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")
    assert drafted > 0


def test_settings_speculation_refuses_fail_the_request_not_the_engine(adaptive_llm, prompts, reference_tokens):
    """vLLM 0.32 refuses min_p and logit_bias with speculative decoding; with the plugin on the
    request fails with vLLM's own validation error and the engine serves the next one."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    for bad in ({"min_p": 0.05, "temperature": 0.8}, {"logit_bias": {13: 1.0}}):
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative decoding"):
            adaptive_llm.generate(prompts[:1], SamplingParams(max_tokens=8, **bad), use_tqdm=False)
    assert greedy(adaptive_llm, prompts[:2]) == reference_tokens[:2]
