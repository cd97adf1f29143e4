"""Grammar stops (integration/grammar.py) on a real xgrammar grammar over the toy target's tokenizer:
matchers follow each request's output, refuse draft tokens the grammar cannot take, and roll drafts back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.paths import TARGET
from vllm_adaptive_spec.integration.grammar import GrammarStops, _Matcher, _Request

REGEX = "abcdx"


@pytest.fixture(scope="module")
def ids() -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    return dict(zip("abcdx", tokenizer.convert_tokens_to_ids(list("abcdx"))))


@pytest.fixture(scope="module")
def compile_regex():
    """A real vLLM xgrammar grammar for REGEX (vLLM's backend, built as its manager builds it)."""
    from transformers import AutoTokenizer
    from vllm.config import StructuredOutputsConfig
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    config = SimpleNamespace(
        structured_outputs_config=StructuredOutputsConfig(),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3")),
        speculative_config=SimpleNamespace(num_speculative_tokens=4),  # the matcher rolls back up to K tokens
    )
    backend = XgrammarBackend(config, tokenizer=tokenizer, vocab_size=len(tokenizer))
    return lambda: backend.compile_grammar(StructuredOutputOptions.REGEX, REGEX)


def _stops(compile_regex, monkeypatch) -> GrammarStops:
    """GrammarStops whose requests compile REGEX at once (no background thread)."""

    def compile_now(self, req_id, params):
        from vllm.v1.structured_output.request import StructuredOutputRequest

        request = _Request(req_id, params, StructuredOutputRequest.from_sampling_params(params))
        request.structured_output_request.grammar = compile_regex()
        return _Matcher(request)

    monkeypatch.setattr(GrammarStops, "_compile", compile_now)
    return GrammarStops(vllm_config=None)


def _state(output: list[int], structured: bool = True):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(regex=REGEX) if structured else None
    return SimpleNamespace(output_token_ids=output, sampling_params=SamplingParams(structured_outputs=so))


def test_a_refused_draft_token_ends_the_rows_round(compile_regex, monkeypatch, ids):
    a, b, c, d, x = (ids[k] for k in "abcdx")
    stops = _stops(compile_regex, monkeypatch)
    requests = {"r": _state([a]), "plain": _state([x, x], structured=False)}
    # this step generated b for "r" (and a token for "plain", which has no grammar)
    assert stops.start_round(["plain", "r"], requests, torch.tensor([[x, -1], [b, -1]]), [1, 1])
    active, keeps, stop = [True, True], [True, True], [False, False]
    stops.refuse([x, c], active, keeps, stop)  # "abc": the grammar takes c
    assert stop == [False, False]
    stops.refuse([x, d], active, keeps, stop)  # "abcd"
    assert stop == [False, False]
    stops.refuse([x, a], active, keeps, stop)  # "abcda": refused, the row stops (its token stays)
    assert stop == [False, True] and stops.stops == 1
    stops.end_round()  # the drafts c, d roll back: the grammar holds "ab" again

    # next round: the output is now "ab" (b was the last step's), and this step accepted c
    requests["r"].output_token_ids = [a, b]
    assert stops.start_round(["r"], requests, torch.tensor([[c, -1]]), [1])  # "abc" (without the roll-back: refused)
    stop = [False]
    stops.refuse([d], [True], [True], stop)  # "abcd"
    assert stop == [False] and stops.stops == 1
    stops.end_round()
    assert stops.num_tracked() == 1
    stops.forget("r")
    assert stops.num_tracked() == 0


def test_rows_that_end_anyway_are_not_offered_their_token(compile_regex, monkeypatch, ids):
    a, b, x = ids["a"], ids["b"], ids["x"]
    stops = _stops(compile_regex, monkeypatch)
    assert stops.start_round(["r"], {"r": _state([])}, torch.tensor([[a, b]]), [2])
    for active, keeps, stop in (([False], [True], [False]), ([True], [False], [True]), ([True], [True], [True])):
        stops.refuse([x], active, keeps, stop)
    assert stops.stops == 0


def test_a_grammar_that_refuses_the_output_makes_no_stops(compile_regex, monkeypatch, ids):
    a, x = ids["a"], ids["x"]
    stops = _stops(compile_regex, monkeypatch)
    assert not stops.start_round(["r"], {"r": _state([x])}, torch.tensor([[a]]), [1])
    assert not stops.start_round(["r"], {"r": _state([x, a])}, torch.tensor([[a]]), [1])  # stays off


def test_no_structured_request_no_round(compile_regex, monkeypatch, ids):
    stops = _stops(compile_regex, monkeypatch)
    assert not stops.start_round(["p"], {"p": _state([1], structured=False)}, torch.tensor([[1]]), [1])
    assert not stops.start_round(["gone"], {}, torch.tensor([[1]]), [1])
    assert stops.num_tracked() == 0


def test_a_backend_error_turns_the_requests_stops_off_instead_of_failing_the_step(compile_regex, monkeypatch, ids):
    a, b, c = ids["a"], ids["b"], ids["c"]
    stops = _stops(compile_regex, monkeypatch)
    assert stops.start_round(["r"], {"r": _state([a])}, torch.tensor([[b]]), [1])
    ((_, _, matcher, grammar),) = stops._round

    def fail(*args):
        raise RuntimeError("backend failure")

    monkeypatch.setattr(grammar, "validate_tokens", fail)
    stop = [False]
    stops.refuse([c], [True], [True], stop)
    assert stop == [False] and matcher.broken and stops.stops == 0
    stops.end_round()
    assert not stops.start_round(["r"], {"r": _state([a, b])}, torch.tensor([[c]]), [1])
