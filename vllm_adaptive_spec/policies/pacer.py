"""Pacer (seed 000): a one-layer pre-verifier judges each block of b draft tokens.

The layer reads h_i, the draft's final hidden state consuming draft token i.
The proposer hands the policy, at draft step t, the hidden state of the
forward that produced q_t, i.e. the one consuming y_{t-1}; so at step t the
policy stores h_{t-1} + e_{t-1} (its position-in-round embedding, added as it
is stored), and when t is a multiple of b (tokens t-b..t-1 form a complete
block) it runs the layer on that block, attending to the request's accepted
context and this round's earlier drafts. If the halting rule fires (mean
alpha over the block <= threshold by default) y_t is dropped and the request
stops with t tokens; otherwise it drafts on, and the round's next block is
judged at threshold * rho (the same for every row still drafting: a row that
stopped is done for the round). No host sync inside `decide`.

Context: a bounded recent window of the last W accepted tokens' draft hidden
states per request (the paper uses the full context; W comes from the layer
file, 64 for the bundled one). The proposer passes each first pass's hidden
states over the newly verified tokens (`observe_context`); they are kept per
request id, deduplicated by sequence position (a round's first row repeats
the previous round's bonus token), and dropped in `forget`. The window is
projected to keys/values once, when it arrives (one layer, no RoPE: a
context token's key and value depend on its own hidden state only), and the
per-request keys/values are gathered once per round into a padded buffer
that also holds the round's drafts: each block projects only its own tokens.
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.heads.pacer import HALTING, check_pacer, go_on, load_pacer
from vllm_adaptive_spec.policies.base import StepDecision, StopPolicy, finite_rows
from vllm_adaptive_spec.policies.params import Param

FIELD = "adaptive_spec.head"


class PacerPolicy(StopPolicy):
    name = "pacer"
    observes_context = True
    PARAMS = {
        "head": Param(str, required=True),
        "block_size": Param(int, 1, 64),
        "threshold": Param(float, 0.0, 1.0),
        "growth": Param(float, 0.5, 2.0),
        "halting": Param(str, choices=HALTING),
        "context_window": Param(int, 0, 1_000_000),
    }

    def __init__(
        self,
        head: str,
        block_size: int | None = None,
        threshold: float | None = None,
        growth: float | None = None,
        halting: str | None = None,
        context_window: int | None = None,
    ):
        self.layer, self.meta = load_pacer(head, FIELD)  # float32, CPU until the first round
        self.layer.freeze()  # inference only (heads.affine)
        m = self.meta
        self.block = int(m["block_size"] if block_size is None else block_size)
        self.threshold = float(m["threshold"] if threshold is None else threshold)
        self.growth = float(m["growth"] if growth is None else growth)
        self.halting = str(m.get("halting", "mean") if halting is None else halting)
        self.window = int(m["context_window"] if context_window is None else context_window)
        self._ctx: dict[str, torch.Tensor] = {}  # req_id -> [n <= W, H] hidden states of accepted tokens
        self._kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # req_id -> 2 x [heads, n, d] of _ctx
        self._next_pos: dict[str, int] = {}  # req_id -> sequence position of the next unseen token
        self._pos_rows: torch.Tensor | None = None  # [cap, H] e_1..e_cap
        self._causal: torch.Tensor | None = None  # [cap, cap] bool
        # Per round:
        self._round: tuple | None = None  # kv buffer [2, B, heads, W' + cap, d], mask [B, cap, W' + cap], W'
        self._drafts: torch.Tensor | None = None  # [B, cap, H] h_i + e_i of this round's drafts
        self._built_for: torch.device | None = None  # the device the layer was moved to and frozen for

    @classmethod
    def check_engine(cls, params: dict, draft_model: str) -> None:
        check_pacer(params["head"], draft_model, FIELD)

    def round_limits(self, req_ids: list[str], cap: int) -> list[int]:
        if self._built_for != self.device:  # as set: a tensor's "cuda:0" never equals a set "cuda"
            self.layer.to(self.device)
            self.layer.freeze()  # on the new device
            self._pos_rows, self._built_for = None, self.device
        b, h = len(req_ids), self.layer.cfg.hidden_size
        cap = max(cap, 1)
        if self._pos_rows is None or self._pos_rows.shape[0] < cap:
            self._pos_rows = self.layer.position_rows(cap, self.device)  # [cap, H]
            self._causal = torch.ones(cap, cap, dtype=torch.bool, device=self.device).tril()  # [cap, cap]
        self._round = None
        self._drafts = torch.empty(b, cap, h, device=self.device)  # slot i is written before it is read
        return [cap] * b

    def observe_context(
        self, req_ids: list[str], hidden: torch.Tensor, starts: list[int], lengths: list[int], positions: list[int]
    ) -> None:
        fresh = []  # per request: [m, H] hidden states of tokens not stored yet
        for req_id, start, n, pos in zip(req_ids, starts, lengths, positions):
            skip = max(0, min(n, self._next_pos.get(req_id, pos) - pos))  # rows already stored
            fresh.append(hidden[start + skip : start + n].float())
            self._next_pos[req_id] = max(self._next_pos.get(req_id, 0), pos + n)
        # A context token's key/value depends on its own hidden state only (one layer, no RoPE):
        # project just the new tokens, in one call for the batch, and keep them per request.
        sizes = [f.shape[0] for f in fresh]
        h = self.layer.cfg.hidden_size
        k_all, v_all = self.layer.context_kv(torch.cat(fresh).reshape(1, -1, h).to(self.device))  # 2 x [1, heads, N, d]
        rows = []
        for req_id, new, k, v in zip(req_ids, fresh, k_all[0].split(sizes, dim=1), v_all[0].split(sizes, dim=1)):
            old, kv = self._ctx.get(req_id), self._kv.get(req_id)
            ctx = new if old is None else torch.cat([old, new])
            if kv is not None:
                k, v = torch.cat([kv[0], k], dim=1), torch.cat([kv[1], v], dim=1)  # [heads, n, d]
            cut = max(0, ctx.shape[0] - self.window)
            self._ctx[req_id] = ctx[cut:]
            self._kv[req_id] = (k[:, cut:], v[:, cut:])
            rows.append(self._kv[req_id])
        self._start_round([r[0].shape[1] for r in rows], rows)

    def _start_round(self, counts: list[int], rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This round's key/value buffer [2, B, heads, W' + cap, d] (context left-aligned, zero padding,
        then room for the drafts) and its mask [B, cap, W' + cap] (valid context, causal drafts).
        Draft slots are written before they are read, so only context padding needs zeros."""
        b, cap = self._drafts.shape[:2]
        heads, d = self.layer.cfg.num_heads, self.layer.cfg.hidden_size // self.layer.cfg.num_heads
        width = max(counts, default=0)
        kv = torch.empty(2, b, heads, width + cap, d, device=self.device)
        for i, (k, v) in enumerate(rows):
            kv[0, i, :, : counts[i]], kv[1, i, :, : counts[i]] = k, v
            if counts[i] < width:
                kv[:, i, :, counts[i] : width] = 0.0
        mask = torch.empty(b, cap, width + cap, dtype=torch.bool, device=self.device)
        if any(n < width for n in counts):
            valid = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]  # [B, W']
            mask[:, :, :width] = valid.to(self.device)[:, None, :]
        else:
            mask[:, :, :width] = True
        mask[:, :, width:] = self._causal[:cap, :cap]
        self._round = (kv, mask, width)

    def decide(
        self, logp: torch.Tensor, tokens: torch.Tensor, t: int, hidden: torch.Tensor | None = None
    ) -> StepDecision:
        ok = finite_rows(logp)  # [B]
        no_stop = self.no_stop(ok)  # a row that fails a block drops y_t: keep = False alone stops it
        if t == 0 or hidden is None or self._drafts is None:
            return StepDecision(keep=ok, stop=no_stop)
        # h of draft token t (1-based), consuming y_{t-1}, plus its embedding e_t (in float32)
        torch.add(hidden, self._pos_rows[t - 1], out=self._drafts[:, t - 1])
        if t % self.block:
            return StepDecision(keep=ok, stop=no_stop)
        if self._round is None:  # no first pass seen this round: judge on the drafts alone
            self._start_round([0] * hidden.shape[0], [])
        kv, mask, width = self._round
        first = t - self.block
        logits = self.layer.score_block(self._drafts[:, first:t], kv, width + first, mask[:, first:t, : width + t])
        # the round's j-th block is judged at threshold * growth^j (rows still drafting passed blocks 0..j-1)
        go = go_on(torch.sigmoid(logits), self.threshold * self.growth ** (first // self.block), self.halting)
        return StepDecision(keep=ok & go, stop=no_stop)

    def forget(self, req_id: str) -> None:
        self._ctx.pop(req_id, None)
        self._kv.pop(req_id, None)
        self._next_pos.pop(req_id, None)

    def num_tracked(self) -> int:
        return len(self._ctx)
