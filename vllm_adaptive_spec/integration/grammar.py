"""Grammar stops: under structured outputs a row stops drafting at its first draft token the grammar refuses.

vLLM's scheduler cuts every draft at its first token the request's grammar refuses before the target
verifies it (the target's pass masks each verified position with the grammar, so it could never accept
that token), and everything drafted after it is thrown away. The loop can know that as soon as the token
is drawn: the worker keeps a matcher per structured request (vLLM's own grammar backend, compiled on
a background thread), advances it over the request's output at the start of each round, offers it
each draft token as it is drawn, and ends the row's round after the first one it refuses. That token
stays in the draft and the scheduler cuts it as before, so what the target verifies does not change:
only when drafting ends. At the round's end the matchers roll their draft tokens back.

With `grammar_mask` the loop also masks each structured row's draft logits, before the draw, to the
tokens its grammar allows next (`mask`): the draft then proposes the best token the target could
accept instead of one the scheduler would cut. A greedy draw masks only the rows whose argmax the
grammar refuses on CPU (`mask_refused`: the same tokens, without the fill where the argmax is allowed).
What the target verifies changes, never what it emits: its own pass applies the same grammar, drafts
are only proposals, and a draft drawn from the masked distribution is verified against that
distribution (ALGORITHMS.md).

A matcher that is not compiled yet, fails to compile or fails to follow the request's own output
(it never should) makes no stops and masks nothing for its request; nothing here can change an
output, only how many draft steps a round runs and which tokens the draft proposes.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """What vLLM's StructuredOutputManager reads of a request to compile its grammar."""

    request_id: str
    sampling_params: Any
    structured_output_request: Any


@dataclass
class _Matcher:
    request: _Request
    fed: int = 0  # output tokens the grammar has consumed
    drafted: int = 0  # draft tokens it has consumed this round (rolled back at the round's end)
    broken: bool = False  # it refused the request's own output: no stops for this request

    @property
    def grammar(self) -> Any:
        """vLLM's compiled grammar, or None while compiling or after a failed compilation."""
        if self.broken:
            return None
        grammar = self.request.structured_output_request.grammar  # None while the future runs
        return None if isinstance(grammar, Exception) else grammar


@dataclass
class GrammarStops:
    vllm_config: Any
    masks: bool = False  # grammar_mask: draws of structured rows only from what the grammar allows
    stops: int = 0  # rows whose round a refused draft token ended
    masked: int = 0  # draft draws made under a grammar's mask
    _matchers: dict[str, _Matcher] = field(default_factory=dict)
    _round: list[tuple[int, str, _Matcher, Any]] = field(default_factory=list)  # (row, request, matcher, grammar)
    _manager: Any = None  # vLLM's StructuredOutputManager, built on the background thread
    _compiler: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "adaptive-spec-grammar"))
    _bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, the backend's layout
    _taken: dict[int, int] = field(default_factory=dict)  # row -> its token this step, taken (mask_refused)

    def start_round(
        self, req_ids: list[str], requests: dict, sampled: torch.Tensor | None, generated: list[int]
    ) -> bool:
        """Advance each structured request's matcher over its output, this step's tokens included.

        requests: the runner's request states (output_token_ids: the output before this step);
        sampled: [B, K+1] this step's tokens, the first generated[i] of row i valid. Returns whether
        any row of this round has a matcher ready (only then does the loop offer it draft tokens).
        One host copy of `sampled` per round, only in rounds with a structured request."""
        self._round = []
        host: list[list[int]] | None = None
        for i, req_id in enumerate(req_ids):
            state = requests.get(req_id)
            params = getattr(state, "sampling_params", None)
            constraint = getattr(params, "structured_outputs", None)
            if constraint is None or constraint.all_constraints_none():
                continue
            matcher = self._matchers.get(req_id)
            if matcher is None:
                matcher = self._matchers[req_id] = self._compile(req_id, params)
            grammar = matcher.grammar
            if grammar is None or sampled is None:
                continue
            if host is None:
                host = sampled.tolist()
            output = state.output_token_ids
            new = list(output[matcher.fed :]) + host[i][: generated[i]]
            if new and not _guarded(matcher, req_id, grammar.accept_tokens, req_id, new):
                if not matcher.broken:  # (a backend error was logged already)
                    logger.warning("vllm-adaptive-spec: request %s's grammar refused its own output", req_id)
                matcher.broken = True
                continue
            matcher.fed = len(output) + generated[i]
            self._round.append((i, req_id, matcher, grammar))
        return bool(self._round)

    def mask(self, logits: torch.Tensor, active: list[bool]) -> None:
        """Before a draft step's draw: logits [B, V] of rows still drafting (active) with a working
        matcher keep what their grammar allows next; the rest become -inf, in place. One grammar fill
        per such row on the host, one copy of the packed mask to the logits' device."""
        rows = [
            (i, req_id, m, g) for i, req_id, m, g in self._round if active[i] and not m.broken and not g.is_terminated()
        ]
        if not rows:
            return
        n, vocab = len(rows), logits.shape[-1]
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = self._manager.backend.allocate_token_bitmask(n)  # [n, W] int32
        packed = self._bitmask[:n]
        for k, (_, req_id, matcher, grammar) in enumerate(rows):
            _guarded(matcher, req_id, grammar.fill_bitmask, packed, k)
            if matcher.broken:  # its grammar failed: the row draws unmasked
                packed[k] = -1
        # Token j is bit j % 32 of word j // 32 (little-endian): numpy's unpackbits does it in one C pass
        # (torch shifts over [n, W, 32] took 3-8x longer here). Host-side, like the fill.
        allowed = torch.from_numpy(np.unpackbits(packed.numpy().view(np.uint8), axis=-1, bitorder="little"))
        if allowed.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)  # [n, V] uint8 0/1
        # +inf where allowed, -inf where not; min() with it is the mask (NaN rows stay NaN). On CPU
        # masked_fill_ / where took about 350 us at [16, 6144]; this, 50.
        ceiling = allowed.to(logits.dtype).sub_(0.5).mul_(float("inf"))  # [n, V]
        if n == logits.shape[0] and all(i == k for k, (i, *_) in enumerate(rows)):
            torch.minimum(logits, ceiling, out=logits)
        else:
            index = torch.tensor([i for i, *_ in rows], device=logits.device)
            logits.index_copy_(0, index, torch.minimum(logits.index_select(0, index), ceiling))
        self.masked += n

    def mask_refused(self, logits: torch.Tensor, tokens: torch.Tensor, active: list[bool]) -> torch.Tensor:
        """A greedy draw: the argmax of a row's masked logits is its argmax itself wherever the grammar
        takes that token, so only rows whose argmax it refuses need the mask. Masks those rows (in place)
        and draws them again -> tokens [B]: the same as masking every row first. A fill costs 100-500 us
        per row where the grammar leaves free text (about 1 us where it forces a token), the check of
        one token a few; the rows left unmasked hand the policy their unmasked distribution.
        tokens: [B] the argmax of logits [B, V]."""
        host = tokens.tolist()
        refused = [False] * len(active)
        self._taken = {}
        for i, req_id, matcher, grammar in self._round:
            if active[i] and not matcher.broken and not grammar.is_terminated():
                if _guarded(matcher, req_id, grammar.validate_tokens, [host[i]]):
                    self._taken[i] = host[i]  # refuse need not check it again
                else:
                    refused[i] = not matcher.broken
        if not any(refused):
            return tokens
        self.mask(logits, refused)
        index = torch.tensor([i for i, r in enumerate(refused) if r], device=logits.device)
        return tokens.index_copy(0, index, logits.index_select(0, index).argmax(dim=-1))

    def refuse(self, tokens: list[int], active: list[bool], keeps: list[bool], stops: list[bool]) -> None:
        """One draft step: offer each row still drafting its kept token; a refused one, or one that ends
        the grammar, ends the row's round (stops[i] = True, in place). tokens: the step's draft tokens
        [B] on the host."""
        taken, self._taken = self._taken, {}
        for i, req_id, matcher, grammar in self._round:
            if not active[i] or not keeps[i] or stops[i] or matcher.broken:
                continue  # the row's round ends anyway, or its grammar failed: nothing to check
            if taken.get(i) == tokens[i] or _guarded(matcher, req_id, grammar.validate_tokens, [tokens[i]]):
                if _guarded(matcher, req_id, grammar.accept_tokens, req_id, [tokens[i]]):
                    matcher.drafted += 1
                    if grammar.is_terminated():  # the token ends the grammar (a stop token): nothing follows
                        stops[i] = True
                        self.stops += 1
            elif not matcher.broken:
                stops[i] = True
                self.stops += 1

    def end_round(self) -> None:
        """Roll the draft tokens back: the matchers hold the requests' output only."""
        for _, req_id, matcher, grammar in self._round:
            if matcher.drafted and not matcher.broken:
                _guarded(matcher, req_id, grammar.rollback, matcher.drafted)
            matcher.drafted = 0
        self._round, self._taken = [], {}

    def forget(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._matchers)

    def _compile(self, req_id: str, params: Any) -> _Matcher:
        from vllm.v1.structured_output.request import StructuredOutputRequest

        request = _Request(req_id, params, StructuredOutputRequest.from_sampling_params(params))
        self._compiler.submit(self._init_grammar, request)
        return _Matcher(request)

    def _init_grammar(self, request: _Request) -> None:
        """On the background thread: vLLM's manager (its backend's tokenizer tables are built on first
        use, seconds for a large vocabulary) starts the grammar's compilation."""
        try:
            if self._manager is None:
                from vllm.v1.structured_output import StructuredOutputManager

                self._manager = StructuredOutputManager(self.vllm_config)
            self._manager.grammar_init(request)
        except Exception as exc:  # the request runs without grammar stops
            logger.warning("vllm-adaptive-spec: no grammar stops for request %s: %s", request.request_id, exc)
            request.structured_output_request.grammar = exc


def _guarded(matcher: _Matcher, req_id: str, op: Any, *args: Any) -> Any:
    """A grammar backend call; an error turns the request's grammar stops off instead of failing the step."""
    try:
        return op(*args)
    except Exception as exc:
        matcher.broken = True
        logger.warning("vllm-adaptive-spec: no more grammar stops for request %s: %r", req_id, exc)
        return None
