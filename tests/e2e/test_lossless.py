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
