"""The context tail: draft tokens a request's own context predicts, appended after the drafter's, free.

After a round's drafts, a row whose context (prompt, output, and this round's drafts) ends with an n-gram
seen earlier in it (n from MAX_N down to MIN_N: the longest that matches) gets up to `max_tokens` more
draft tokens: those that followed that n-gram's most recent earlier occurrence, as prompt lookup drafts
them (vLLM's `ngram` method, which has no draft model). And a row whose context predicts its next token
at the round's start drafts one token (the first pass's, which the drafter computes anyway) before its
tail: the draft model's later steps cost forwards, the tail costs none.

Why: the drafter stops at its first unsure token; when the context repeats, the tokens after it are
known for nothing. On the toy target's greedy responses to 300 training prompts, replayed with the
bundled draft model (README, "The context tail"), S at c = 4 went from copy's 1.59 / 1.55 (code / prose)
to 2.59 / 3.18 with a tail of 15, against prompt lookup alone at 2.67 / 3.55: the toy target's outputs
repeat their context heavily, so there lookup is the stronger drafter; real models repeat less.

Where the batch gate runs, `TailGate` cuts the tails to the length that pays for its verification on the
gate's cost curves (its docstring; `adaptive_spec.tail_gate`).

Lossless: the tail is a function of tokens known before it is proposed (a draft of probability one:
the loop gives vLLM's rejection sampler one-hot draft probabilities for it), so sampling keeps the
target's distribution and greedy output is the target's. Host-side only: per request a list of its
tokens and a dict from each n-gram to where it last ended, fed the tokens each round gained.
"""

from __future__ import annotations

import torch

MIN_N, MAX_N = 2, 3  # n-gram lengths matched (longest first)
WINDOW = 4096  # TailGate: a rate's counts halve once they pass this many trials (it follows the workload)


class _History:
    """One request's tokens and, per n-gram that has a successor, the index of its last token."""

    __slots__ = ("tokens", "ends")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> its most recent end that a token followed

    def extend(self, new: list[int]) -> None:
        tokens, ends = self.tokens, self.ends
        for x in new:
            j = len(tokens)  # x is token j: the n-grams ending at j - 1 now have a successor
            for n in range(MIN_N, MAX_N + 1):
                if j >= n:
                    ends[tuple(tokens[j - n : j])] = j - 1
            tokens.append(x)

    def follow(self, drafts: list[int], m: int) -> list[int]:
        """Up to m tokens that followed the most recent earlier occurrence of the longest n-gram ending
        the context (its tokens, then `drafts`); [] when none matches."""
        if m <= 0:
            return []
        tokens = self.tokens
        recent = (tokens[-MAX_N:] + drafts)[-MAX_N:]
        for n in range(min(MAX_N, len(recent)), MIN_N - 1, -1):
            end = self.ends.get(tuple(recent[-n:]))
            if end is not None:
                out = tokens[end + 1 : end + 1 + m]  # the context runs on into this round's drafts
                return out + drafts[: m - len(out)] if len(out) < m else out
        return []


class ContextTail:
    """Per request: what its context predicts after a round's drafts (module docstring)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._histories: dict[str, _History] = {}

    # -- fed like a policy that reads tokens (the loop's _feed_tokens) --

    def tokens_seen(self, req_id: str) -> int:
        h = self._histories.get(req_id)
        return 0 if h is None else len(h.tokens)

    def observe_tokens(self, req_ids: list[str], new: list[list[int]]) -> None:
        for req_id, tokens in zip(req_ids, new):
            if tokens:
                self._histories.setdefault(req_id, _History()).extend(tokens)

    def forget(self, req_id: str) -> None:
        self._histories.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._histories)

    # -- a round --

    def predicts(self, req_id: str) -> bool:
        """Whether the request's context predicts its next token (a tail would start now)."""
        h = self._histories.get(req_id)
        return h is not None and bool(h.follow([], 1))

    def tail(self, req_id: str, drafts: list[int], room: int) -> list[int]:
        """The tokens to append after `drafts`: at most max_tokens, at most `room`."""
        h = self._histories.get(req_id)
        return [] if h is None else h.follow(drafts, min(self.max_tokens, room))


class TailGate:
    """Whether a tail's tokens pay for their verification, at the batch's measured costs.

    A tail costs no draft forward, but every tail token is one more token the target verifies, and where
    a pass costs more the more tokens it verifies (a CPU, or a GPU past its bandwidth-bound batch sizes)
    a token accepted half the time may cost more than it adds. After a round's drafts the gate cuts every
    row's tail to the common length L (0 up to the longest) at which the round's expected output per unit
    of time is largest, as the batch gate (batch_gate.py) judges a draft step:

        G(L) = n + sum_i sum_{j <= d_i} a^j + sum_i a^{d_i} sum_{l <= min(L, t_i)} prod_{k <= l} p_k
        C(L) = draft side + V(n + sum_i d_i + sum_i min(L, t_i))

    n rows, d_i drafts and t_i tail tokens in row i; a: the drafter's acceptance rate, p_k: the rate at
    which a tail token at position k was accepted once the target reached it, both counted online from
    what the target accepted (a Beta(1, 1) prior each; the counts halve past WINDOW trials); V: the cost
    curve of a pass over x tokens and the draft side: the round's forwards at D(n) (`costs.StepCosts`).
    It runs where the batch gate runs (`adaptive_spec.batch_aware`) and on its curves. The cut uses only
    what was known before the tail was proposed (earlier rounds, this round's drafts), and tail tokens
    are drafts of probability one, so dropping them keeps the target's distribution.
    """

    def __init__(self, max_tokens: int):
        self.drafts = [1.0, 2.0]  # the drafter's drafts: accepted, reached (Beta(1, 1) prior)
        self.reached = [2.0] * max_tokens  # per tail position: the target reached it (prior 2)
        self.accepted = [1.0] * max_tokens  # ... and accepted it (prior 1)

    def learn(self, drafts: list[int], tails: list[int], accepted: list[int]) -> None:
        """Per verified row: the drafter's drafts, its tail tokens, and the drafts the target accepted."""
        for d, t, a in zip(drafts, tails, accepted):
            self.drafts[0] += min(a, d)
            self.drafts[1] += min(a + 1, d)
            for k in range(min(t, a - d + 1) if a >= d else 0):  # tail position k was reached
                self.reached[k] += 1.0
                self.accepted[k] += float(a >= d + k + 1)
        if self.drafts[1] > WINDOW:
            self.drafts = [x / 2 for x in self.drafts]
        for k, n in enumerate(self.reached):
            if n > WINDOW:
                self.reached[k], self.accepted[k] = n / 2, self.accepted[k] / 2

    def length(self, drafts: list[int], tails: list[int], draft_ms: float, verify: list[float]) -> int:
        """The common tail length that maximizes G(L) / C(L) (class docstring); verify: pass cost per
        token count, 0 .. at least n + sum(drafts) + sum(tails)."""
        a = self.drafts[0] / self.drafts[1]
        p = [x / y for x, y in zip(self.accepted, self.reached)]
        tokens = len(drafts) + sum(drafts)
        gain = len(drafts) + sum(a * (1.0 - a**d) / (1.0 - a) if a < 1.0 else float(d) for d in drafts)
        reach = [a**d for d in drafts]  # per row: the target reaches its tail
        best, best_rate = 0, gain / (draft_ms + verify[tokens])
        for length in range(1, min(max(tails, default=0), len(p)) + 1):
            for i, t in enumerate(tails):
                if t >= length:
                    reach[i] *= p[length - 1]
                    gain += reach[i]
                    tokens += 1
            rate = gain / (draft_ms + verify[tokens])
            if rate > best_rate:
                best, best_rate = length, rate
        return best


def with_tail_probs(probs: torch.Tensor, drafts: list[list[int]], starts: list[int]) -> torch.Tensor:
    """The round's draft probabilities [B, T, V] for rows that end in a tail: [B, max(T, longest row), V],
    row i's positions from starts[i] to the end of drafts[i] (its tail) one-hot at its tokens."""
    width = max(probs.shape[1], max(map(len, drafts), default=0))
    if width > probs.shape[1]:
        probs = torch.cat([probs, probs.new_zeros(probs.shape[0], width - probs.shape[1], probs.shape[2])], 1)
    for i, (row, start) in enumerate(zip(drafts, starts)):
        if start < len(row):
            where = torch.arange(start, len(row), device=probs.device)  # [n] the tail's positions
            probs[i, where] = 0.0
            probs[i, where, torch.tensor(row[start:], device=probs.device)] = 1.0
    return probs
