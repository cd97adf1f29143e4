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
def backend():
    """vLLM's xgrammar backend over the toy target's tokenizer, built as its manager builds it."""
    from transformers import AutoTokenizer
    from vllm.config import StructuredOutputsConfig
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    config = SimpleNamespace(
        structured_outputs_config=StructuredOutputsConfig(),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3")),
        speculative_config=SimpleNamespace(num_speculative_tokens=4),  # the matcher rolls back up to K tokens
    )
    return XgrammarBackend(config, tokenizer=tokenizer, vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def compile_regex(backend):
    """A real vLLM xgrammar grammar for REGEX."""
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    return lambda: backend.compile_grammar(StructuredOutputOptions.REGEX, REGEX)


def _stops(compile_regex, monkeypatch, backend=None) -> GrammarStops:
    """GrammarStops whose requests compile REGEX at once (no background thread)."""

    def compile_now(self, req_id, params):
        from vllm.v1.structured_output.request import StructuredOutputRequest

        request = _Request(req_id, params, StructuredOutputRequest.from_sampling_params(params))
        request.structured_output_request.grammar = compile_regex()
        return _Matcher(request)

    monkeypatch.setattr(GrammarStops, "_compile", compile_now)
    stops = GrammarStops(vllm_config=None, masks=backend is not None)
    stops._manager = SimpleNamespace(backend=backend)  # what mask() reads of vLLM's manager
    return stops


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


def _allowed(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits > float("-inf")).flatten().tolist())


def test_the_mask_leaves_each_row_what_its_grammar_takes_next(compile_regex, monkeypatch, backend, ids):
    """The masked ids are exactly the tokens whose text continues REGEX from where the matcher is (checked
    against the tokenizer), rows without a grammar or no longer drafting keep their logits, and a masked
    row follows its accepted drafts."""
    from transformers import AutoTokenizer

    a, b, c, d, x = (ids[k] for k in "abcdx")
    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    vocab = 6144  # the toy target's logits width
    stops = _stops(compile_regex, monkeypatch, backend)

    def continuing(rest: str) -> set[int]:  # ids whose text is a non-empty prefix of what the regex wants next
        return {i for i in range(len(tokenizer)) if (t := tokenizer.decode([i])) and rest.startswith(t)}

    requests = {"r": _state([a]), "plain": _state([x], structured=False), "idle": _state([a])}
    assert stops.start_round(["plain", "r", "idle"], requests, torch.tensor([[x], [b], [b]]), [1, 1, 1])  # "ab"
    logits = torch.randn(3, vocab)
    before = logits.clone()
    stops.mask(logits, [True, True, False])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert _allowed(logits[1]) == continuing("cdx") and c in _allowed(logits[1])
    assert torch.equal(logits[1][list(_allowed(logits[1]))], before[1][list(_allowed(logits[1]))])
    stop = [False, False, False]
    stops.refuse([x, c, c], [True, True, False], [True, True, True], stop)  # "abc"
    logits = torch.randn(3, vocab)
    stops.mask(logits, [True, True, False])
    assert _allowed(logits[1]) == continuing("dx") and d in _allowed(logits[1])
    assert stops.masked == 2 and stops.stops == 0
    stops.end_round()


def test_the_mask_on_every_row_in_bfloat16(compile_regex, monkeypatch, backend, ids):
    """Every row structured and drafting (the mask applies in place, without the row gather), on the
    draft's bfloat16 logits: each row keeps exactly its grammar's next tokens, their values untouched."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    a, b, c = ids["a"], ids["b"], ids["c"]
    stops = _stops(compile_regex, monkeypatch, backend)
    assert stops.start_round(["r", "s"], {"r": _state([a]), "s": _state([a, b])}, torch.tensor([[b], [c]]), [1, 1])
    logits = torch.randn(2, 6144).bfloat16()
    before = logits.clone()
    stops.mask(logits, [True, True])
    for row, rest in enumerate(("cdx", "dx")):  # "ab" and "abc" so far
        want = {i for i in range(len(tokenizer)) if (t := tokenizer.decode([i])) and rest.startswith(t)}
        kept = sorted(_allowed(logits[row]))
        assert set(kept) == want and torch.equal(logits[row, kept], before[row, kept])
    stops.end_round()


def test_a_greedy_draw_masks_only_rows_whose_argmax_the_grammar_refuses(compile_regex, monkeypatch, backend, ids):
    """mask_refused: the same tokens as masking every row before the argmax; a row whose argmax the grammar
    takes keeps its logits (no fill), a refused one is masked and drawn again, a plain row is untouched."""
    a, b, c, x = ids["a"], ids["b"], ids["c"], ids["x"]
    stops = _stops(compile_regex, monkeypatch, backend)
    requests = {"ok": _state([a]), "bad": _state([a]), "plain": _state([x], structured=False)}
    assert stops.start_round(["ok", "bad", "plain"], requests, torch.tensor([[b], [b], [x]]), [1, 1, 1])  # "ab"
    logits = torch.randn(3, 6144)
    logits[0, c] = 50.0  # the grammar takes c next
    logits[1, x], logits[1, c] = 50.0, 20.0  # it refuses x; c is the best it allows
    logits[2, x] = 50.0
    full = logits.clone()
    stops.mask(full, [True, True, False])
    before = logits.clone()
    tokens = stops.mask_refused(logits, logits.argmax(-1), [True, True, True])
    assert tokens.tolist() == full.argmax(-1).tolist() == [c, c, x]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])  # not masked
    assert torch.equal(logits[1], full[1]) and stops.masked == 2 + 1
    checked = []
    for _, _, _, grammar in stops._round:  # refuse checks only the token mask_refused did not see taken
        monkeypatch.setattr(grammar, "validate_tokens", lambda t, v=grammar.validate_tokens: checked.append(t) or v(t))
    stop = [False, False, False]
    stops.refuse(tokens.tolist(), [True, True, True], [True, True, True], stop)
    assert stop == [False, False, False] and checked == [[c]]  # row "bad"'s redrawn c; row "ok"'s c was seen
    stops.end_round()


def test_a_row_whose_grammar_fails_draws_unmasked(compile_regex, monkeypatch, backend, ids):
    a, b = ids["a"], ids["b"]
    stops = _stops(compile_regex, monkeypatch, backend)
    assert stops.start_round(["r"], {"r": _state([a])}, torch.tensor([[b]]), [1])
    ((_, _, matcher, grammar),) = stops._round

    def fail(*args):
        raise RuntimeError("backend failure")

    monkeypatch.setattr(grammar, "fill_bitmask", fail)
    logits = torch.randn(1, 6144)
    before = logits.clone()
    stops.mask(logits, [True])
    assert matcher.broken and torch.equal(logits, before)
    stops.mask(logits, [True])  # broken: not even offered again
    assert stops.masked == 1


def test_a_token_that_ends_the_grammar_ends_the_rows_round(compile_regex, monkeypatch, backend, ids):
    """After the stop token nothing can follow: the row stops there (the token kept), and its matcher,
    ended, is neither asked for a mask nor counted as broken; the round's end rolls it back."""
    from transformers import AutoTokenizer

    a, b, c, d, x = (ids[k] for k in "abcdx")
    eos = AutoTokenizer.from_pretrained(str(TARGET)).eos_token_id
    stops = _stops(compile_regex, monkeypatch, backend)
    assert stops.start_round(["r"], {"r": _state([a, b, c])}, torch.tensor([[d]]), [1])  # "abcd"
    ((_, _, matcher, grammar),) = stops._round
    stop = [False]
    stops.refuse([x], [True], [True], stop)  # "abcdx": the regex is complete, the grammar not ended
    assert stop == [False]
    logits = torch.randn(1, 6144)
    stops.mask(logits, [True])
    assert eos in _allowed(logits[0]) and x not in _allowed(logits[0])
    stops.refuse([eos], [True], [True], stop)
    assert stop == [True] and stops.stops == 1 and grammar.is_terminated()
    logits = torch.randn(1, 6144)
    before = logits.clone()
    stops.mask(logits, [True])
    assert torch.equal(logits, before) and not matcher.broken
    stops.end_round()
    assert not grammar.is_terminated() and grammar.validate_tokens([x]) == [x]  # back at "abcd"
