"""The one interface every stopping policy implements.

A round (one target step) drafts at most K tokens per request. After draft
token t (0-based) is sampled for every request still drafting, the policy
sees the draft's log-distribution log q_t, the sampled tokens and the draft's
final hidden state that produced them (the position consuming draft token
t-1, or the last verified token when t = 0) and returns two masks: which
rows keep y_t and which stop drafting after it. A row that does not keep y_t
stops whatever its stop says (the loop reads stop only for kept rows). All
decisions are tensor ops on the device: no host sync inside the draft loop.
Rows with NaN/inf logits stop without keeping their token; each policy's
comparisons are written so that a NaN score means "do not keep".

Inside the engine a policy's cost is mostly the number of tensor ops it
launches, each paying for its code run cold after the draft forward (about
8 us an op on the 2-core CPU against 1-2 us in a hot loop), so the policies
spend as few as they can.

Per-request state that lives across rounds (AdaEDL's threshold, the
heuristic's length) is keyed by request id, owned by the policy, and dropped
with `forget` when the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_adaptive_spec.policies.params import Param


@dataclass
class StepDecision:
    keep: torch.Tensor  # [B] bool: y_t stays in the draft
    stop: torch.Tensor  # [B] bool: no more draft tokens for this row this round


def neg_entropy(logp: torch.Tensor) -> torch.Tensor:
    """-H = sum q log q in nats, from log-probabilities. logp: [B, V] -> [B].

    NaN in, NaN out; log q = -inf (masked tokens) contributes 0 (the clamp
    keeps 0 * -inf from turning into NaN). q comes from softmax(log q), equal to
    exp(log q) up to rounding: on CPU `exp` enters an OpenMP parallel region at
    any size (inside the engine its call cost 14 us against softmax's 12 us
    cold, 6 against 5 warm) and the whole rule took about 30% longer with it.
    """
    finite_logp = logp.clamp_min(torch.finfo(logp.dtype).min)
    return torch.linalg.vecdot(torch.softmax(logp, dim=-1), finite_logp)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """H = -sum q log q in nats. logp: [B, V] -> [B] (see neg_entropy)."""
    return -neg_entropy(logp)


_NEG_INF = torch.tensor(float("-inf"))  # 0-dim: usable beside tensors on any device


def finite_rows(logp: torch.Tensor) -> torch.Tensor:
    """[B, V] log-probabilities -> [B] bool: False for rows holding NaN (log_softmax turns inf logits
    into NaN). The row max is NaN then, and a log-probability max is never +inf, so `max > -inf`
    says it (a third of isfinite's cost per call on CPU)."""
    return torch.gt(logp.amax(dim=-1), _NEG_INF)


class StopPolicy:
    """Base: the fixed policy's behaviour (draft the full cap, never stop early)."""

    name = "fixed"
    PARAMS: dict[str, Param] = {}  # constructor keyword -> allowed type and range
    device = torch.device("cpu")  # where per-round state tensors live; set by the proposer

    def no_stop(self, keep: torch.Tensor) -> torch.Tensor:
        """[B] all False, like keep, cached per size and device: the stop of a policy whose rows stop
        exactly when they drop y_t (a row not kept stops), one tensor op fewer per step than ~keep."""
        cache = self.__dict__.setdefault("_no_stop", {})
        key = (keep.shape[0], keep.device)
        if key not in cache:
            cache[key] = torch.zeros_like(keep)
        return cache[key]

    @classmethod
    def check_engine(cls, params: dict, draft_model: str) -> None:
        """Start-up check against the engine's draft model (e.g. a trained head
        fits it); raises ConfigError. Runs in the front-end process."""

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        """Upper bound on this round's draft length per request (<= cap)."""
        return [cap] * len(req_ids)

    observes_context = False  # True: the proposer calls observe_context after each first pass

    def observe_context(
        self, req_ids: list[str], hidden: torch.Tensor, starts: list[int], lengths: list[int], positions: list[int]
    ) -> None:
        """The draft's first pass of the round (only for policies with observes_context).

        hidden: [N, H] the pass's final hidden states; request i's verified tokens
        (previous bonus token, accepted drafts, new bonus token; the prompt on a
        first round) consumed at rows starts[i]..starts[i]+lengths[i]-1, the first
        at sequence position positions[i]. Rows of rejected drafts are excluded."""

    reads_tokens = False  # True: the proposer calls observe_tokens at each round start

    def tokens_seen(self, req_id: str) -> int:
        """(reads_tokens) How many of the request's tokens (prompt, then output) the policy has read."""
        return 0

    def observe_tokens(self, req_ids: list[str], new: list[list[int]]) -> None:
        """(reads_tokens) Before round_limits: each request's tokens after the first tokens_seen of
        them, up to and including this step's."""

    # The batch gate (`batch_aware`) runs on rounds of at least this many rows. 1: every round, as for a
    # rule with no cost model of its own (the gate then decides at batch 1 too); 2: the rule decides a lone
    # request's round by itself (copy: its rule was tuned for batch 1, and the gate only lost there).
    gate_min_rows = 1

    def gate_top(self, top: torch.Tensor) -> torch.Tensor:
        """The batch gate's evidence for the step just decided: top [B] = log q_max of each row
        (`batch_gate.draft_top`) -> [B], as confident as the policy judges each draft. A policy that
        knows more than q (copy: the draft repeats its context) raises it; the gate's online estimator
        still learns what each value means from verification."""
        return top

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        """logp: [B, V] log of the draft distribution that produced tokens: [B];
        hidden: [B, H] the draft's final hidden state that produced logp."""
        ok = finite_rows(logp)
        return StepDecision(keep=ok, stop=self.no_stop(ok))

    trims = False  # True: the proposer calls admit after the round's loop

    def admit(self, lengths: torch.Tensor) -> torch.Tensor:
        """After the loop (only for policies with trims): lengths [B], the drafts each row holds ->
        how many of them go to verification (a prefix of each). Decided from what was known
        before each trimmed draft was drawn, like every keep decision."""
        return lengths

    def end_round(self, req_ids: list[str], drafted: list[int], accepted: list[int]) -> None:
        """Feedback after verification: per request, tokens drafted and accepted."""

    def forget(self, req_id: str) -> None:
        """The request finished or was preempted: drop its state."""

    def num_tracked(self) -> int:
        """Requests with live state (for leak checks)."""
        return 0
