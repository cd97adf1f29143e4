"""copy: keep drafting while the draft repeats its request's context, or is confident.

After sampling y_t (kept), stop unless y_t continues a trigram already seen in the request's tokens
(the two tokens before y_t, drafts of this round included, were followed by y_t somewhere earlier in
the prompt or output) or q_t(y_t) >= threshold (default 0.7).

Why: a draft that repeats what its context already did is the draft a target most often agrees
with (the signal prompt-lookup and suffix decoding draft from), and q_t alone says little about it
for a weak draft: on the toy target's greedy responses to 300 training prompts, replayed
teacher-forced with the bundled draft model at c = 4 and 6.5, confidence at its best training
threshold was 4% behind to 1% ahead of the best fixed K (K=2) while this rule was 13-16% ahead
(33-42% of the oracle's gain; threshold chosen on one half, scored on the other;
`benchmarks/copy_signal.py`, README "The copy signal"). For the EAGLE-3 head it adds little over q_t.

The batch gate (`batch_aware`, on by default) runs only on rounds of two or more rows
(`gate_min_rows`): a lone request's round is the rule's alone. The gate sees a repeat only as a
confident draft; on the training replay at batch 1 it cost the rule 1.1% / 2.9% (code / prose, S at
c = 5.6, `benchmarks/gate_replay.py`; 1.5% / 5.6% with the estimator it used before), and in the scaled
draft-model regime at batch 1, 5% on the wall clock (copy 1.41x / 1.36x no speculation with the gate,
1.48x / 1.39x without; README, "The copy rule in regime (b)").

The context index lives on the host, per request: every trigram (a, b) -> the set of tokens that
followed it, fed at each round start with the tokens the request gained since the last round
(`observe_tokens`, this step's included) and dropped with the request (`forget`). A step reads the
drawn tokens once on the host (one [B] copy: on a GPU a sync, beside the one the loop makes per step
anyway) and does one dict lookup per row. The decision to stop after y_t depends on y_t and on what
came before it, never drops y_t: a stopping time (ALGORITHMS.md), so sampling stays lossless.
"""

from __future__ import annotations

import math

import torch

from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy
from vllm_adaptive_spec.policies.params import Param

# The batch gate's evidence for a draft that repeats its context: as if q_max were 0.94, the share of
# such drafts the target accepted at a round's first step on the training replay (300 responses, the
# bundled draft model; by q: 0.89 for q < 0.2, 0.94-1.00 above, against 0.17-0.98 for the others).
# The gate's online estimator maps it to acceptance from what verification then shows.
REPEAT_LOG_Q = math.log(0.94)


class _Context:
    """One request's trigram index: (a, b) -> tokens seen after them, and its last two tokens."""

    __slots__ = ("follow", "tail", "seen")

    def __init__(self) -> None:
        self.follow: dict[tuple[int, int], set[int]] = {}
        self.tail: tuple[int, ...] = ()
        self.seen = 0  # tokens indexed (prompt and output)

    def extend(self, tokens: list[int]) -> None:
        follow, tail = self.follow, self.tail
        for x in tokens:
            if len(tail) == 2:
                follow.setdefault(tail, set()).add(x)  # type: ignore[arg-type]
                tail = (tail[1], x)
            else:
                tail = (*tail, x)
        self.tail, self.seen = tail, self.seen + len(tokens)


class CopyPolicy(StopPolicy):
    name = "copy"
    PARAMS = {"threshold": Param(float, 0.0, 1.0)}
    reads_tokens = True
    gate_min_rows = 2  # the rule alone decides a lone request's round (module docstring)

    def __init__(self, threshold: float = 0.7):
        self.threshold = threshold
        self._log_threshold = math.log(threshold) if threshold > 0 else -math.inf
        self._contexts: dict[str, _Context] = {}
        self._round: list[tuple[_Context | None, tuple[int, ...]]] = []  # per row: its index, the key now
        self._repeat = torch.zeros(0, dtype=torch.bool)  # [B] the last step's drafts that repeat

    def tokens_seen(self, req_id: str) -> int:
        ctx = self._contexts.get(req_id)
        return 0 if ctx is None else ctx.seen

    def observe_tokens(self, req_ids: list[str], new: list[list[int]]) -> None:
        for req_id, tokens in zip(req_ids, new):
            if tokens:
                self._contexts.setdefault(req_id, _Context()).extend(tokens)

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        rows = [self._contexts.get(r) for r in req_ids]
        self._round = [(ctx, ctx.tail if ctx is not None else ()) for ctx in rows]
        return [cap] * len(req_ids)

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        logq = logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B] log q_t(y_t), NaN for bad rows
        repeats = []
        for i, y in enumerate(tokens.tolist()):
            ctx, key = self._round[i] if i < len(self._round) else (None, ())
            repeats.append(ctx is not None and len(key) == 2 and y in ctx.follow.get(key, ()))  # type: ignore[arg-type]
            if i < len(self._round):
                self._round[i] = (ctx, (*key[-1:], y))
        repeat = torch.tensor(repeats, dtype=torch.bool, device=logp.device)  # [B]
        self._repeat = repeat
        return StepDecision(keep=logq == logq, stop=~repeat & (logq < self._log_threshold))  # NaN: not kept

    def gate_top(self, top: torch.Tensor) -> torch.Tensor:
        """A repeated draft counts for the gate as one the draft is sure of (REPEAT_LOG_Q)."""
        return torch.where(self._repeat, top.clamp_min(REPEAT_LOG_Q), top)  # [B]

    def forget(self, req_id: str) -> None:
        self._contexts.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._contexts)
