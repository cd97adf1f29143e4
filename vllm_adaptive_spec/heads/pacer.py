"""Pacer blockwise pre-verifier (seed 000; ALGORITHMS.md, "Pacer blockwise pre-verifier").

M_B: one pre-norm transformer decoder layer at the draft's hidden size H
(RMSNorm, multi-head self-attention under an explicit boolean mask, RMSNorm,
SiLU MLP), then RMSNorm + Linear(H, 1); alpha_i = sigmoid(M_B(...)_i)
estimates P(draft token i of the round is accepted).

Inputs are the draft's final hidden states (after its last norm, what vLLM's
draft returns), h_i at the position consuming token i:
- draft token i of the round (1-based, i <= K_max): h_i + e_i, e_i a learned
  embedding of the position within the round (`use_position=False` for the
  ablation drops them);
- accepted context tokens: h alone (no position-in-round embedding, i.e.
  e_0 = 0), as in the paper.
No RoPE: the draft's hidden states already carry their own position, the
draft-position embedding says where a token sits inside the round, and the
context is a short recent window, so attention over it as a set is enough.

Because M_B is a single layer, a context token's key and value depend only on
its own hidden state; the context needs no causal pass of its own, and the
policy projects each context token once and keeps its keys/values. Within a
round, `score_block` projects only the new block and reuses the keys/values
of the context and the earlier blocks.

Inference (App. A, Alg. 1): draft b tokens, run M_B on that block, stop if
mean(alpha over the block) <= t, else t <- t * rho and draft the next block.
`halt` also offers the paper's alternatives ("any": some alpha < t; "last":
the block's last alpha < t).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_adaptive_spec.errors import ConfigError
from vllm_adaptive_spec.heads.affine import Affine, NormAffine
from vllm_adaptive_spec.heads.fileformat import check_draft, load_head_module, save_head_file

KIND = "pacer"
ARCHITECTURE = "pacer"
HALTING = ("mean", "any", "last")


@dataclass(frozen=True)
class PacerConfig:
    hidden_size: int  # the draft's hidden size H
    num_heads: int = 4
    mlp_size: int = 512  # MLP inner width
    max_draft: int = 16  # K_max: position-in-round embeddings e_1..e_K_max
    use_position: bool = True  # False: no e_i (ablation)
    eps: float = 1e-6  # RMSNorm


class PacerLayer(nn.Module):
    def __init__(self, cfg: PacerConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of num_heads {cfg.num_heads}")
        self.cfg = cfg
        h = cfg.hidden_size
        self.pos = nn.Embedding(cfg.max_draft + 1, h)  # row 0: context tokens, kept at zero
        self.norm_attn = nn.RMSNorm(h, eps=cfg.eps)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.norm_mlp = nn.RMSNorm(h, eps=cfg.eps)
        self.up = nn.Linear(h, cfg.mlp_size)
        self.down = nn.Linear(cfg.mlp_size, h)
        self.norm_out = nn.RMSNorm(h, eps=cfg.eps)
        self.out = nn.Linear(h, 1)
        nn.init.normal_(self.pos.weight, std=0.02)
        with torch.no_grad():
            self.pos.weight[0].zero_()
        for lin in (self.qkv, self.proj, self.up, self.down):
            nn.init.normal_(lin.weight, std=0.02)
        self._affine: dict[str, Affine] | None = None  # set by freeze() (inference)

    def freeze(self) -> None:
        """Inference from here on: the linear maps run through heads.affine (far cheaper per call on
        CPU at a few rows). Uses the weights and device of now: call again after moving or training."""
        h, eps = self.cfg.hidden_size, self.cfg.eps
        self._affine = {  # the maps behind a norm take it in (NormAffine)
            "qkv": NormAffine(self.norm_attn.weight, eps, self.qkv.weight),
            "kv": NormAffine(self.norm_attn.weight, eps, self.qkv.weight[h:]),  # keys, values (context_kv)
            "proj": Affine(self.proj.weight),
            "up": NormAffine(self.norm_mlp.weight, eps, self.up.weight, self.up.bias),
            "down": Affine.of(self.down),
            "out": NormAffine(self.norm_out.weight, eps, self.out.weight, self.out.bias),
        }

    _NORM_OF = {"qkv": "norm_attn", "kv": "norm_attn", "up": "norm_mlp", "out": "norm_out"}

    def _linear(self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's linear map `name` (qkv, kv, proj, up, down, out) applied to x [..., in], after
        its RMSNorm for the maps that have one (qkv, kv: norm_attn; up: norm_mlp; out: norm_out),
        plus `residual` [..., out] when given (frozen: taken into the product's one call)."""
        if self._affine is not None:  # only the maps without a norm (proj, down) are given a residual
            return self._affine[name](x) if residual is None else self._affine[name](x, residual)
        if name in self._NORM_OF:
            x = F.rms_norm(x, (x.shape[-1],), getattr(self, self._NORM_OF[name]).weight, self.cfg.eps)
        if name == "kv":
            y = F.linear(x, self.qkv.weight[self.cfg.hidden_size :])
        else:
            lin = getattr(self, name)
            y = F.linear(x, lin.weight, lin.bias)
        return y if residual is None else residual + y

    def embed(self, hidden: torch.Tensor, draft_pos: torch.Tensor) -> torch.Tensor:
        """hidden: [..., T, H]; draft_pos: [..., T] long, 0 = context, i = draft token i -> x [..., T, H]."""
        if not self.cfg.use_position:
            return hidden
        emb = self.pos(draft_pos.clamp(0, self.cfg.max_draft))  # [..., T, H]
        return hidden + emb * (draft_pos > 0).unsqueeze(-1)  # context: e_0 = 0 always

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] (embedded) -> q, k, v stacked: [3, B, heads, T, H / heads] (a view)."""
        b, t, h = x.shape
        nh = self.cfg.num_heads
        # Functional calls on the modules' weights: the same maths, without nn.Module call
        # overhead, which dominates this small layer's time at inference.
        return self._linear("qkv", x).view(b, t, 3, nh, h // nh).permute(2, 0, 3, 1, 4)

    def _finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
        """Attention of q over k, v under mask [B, Q, T] bool, then MLP and output -> logits [B, Q].
        Each residual add rides on its linear map's call (one tensor op fewer each, frozen)."""
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))  # [B, heads, Q, d]
        x = self._linear("proj", a.transpose(1, 2).reshape(x.shape), x)
        x = self._linear("down", F.silu(self._linear("up", x)), x)
        return self._linear("out", x).squeeze(-1)

    def forward(self, hidden: torch.Tensor, draft_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Packed sequences (training). hidden: [B, T, H]; draft_pos: [B, T]; mask: [B, T, T] bool
        (True: row may attend to column; every row must see at least itself) -> logits [B, T]."""
        x = self.embed(hidden, draft_pos)
        q, k, v = self._qkv(x)
        return self._finish(x, q, k, v, mask.expand(hidden.shape[0], -1, -1))

    def context_kv(self, context: torch.Tensor) -> torch.Tensor:
        """Keys and values of accepted context tokens (no embedding): [B, W, H] -> [2, B, heads, W, d]
        (k, v stacked: a view; `k, v = layer.context_kv(...)` unpacks it).

        One layer: a context token's key and value depend on its own hidden state only, and
        its query is never needed (context rows carry no output), so only W_k, W_v are applied."""
        b, t, h = context.shape
        nh = self.cfg.num_heads
        return self._linear("kv", context).view(b, t, 2, nh, h // nh).permute(2, 0, 3, 1, 4)

    def score(
        self,
        ctx_kv: torch.Tensor,
        ctx_valid: torch.Tensor,
        drafts: torch.Tensor,
        first: int,
    ) -> torch.Tensor:
        """One round at once: the logits of draft tokens first+1..t given the context and all drafts.

        ctx_kv: from `context_kv`, [2, B, heads, W, d]; ctx_valid: [B, W] bool;
        drafts: [B, t, H] hidden states of this round's draft tokens 1..t -> [B, t - first].
        Equals `forward` on the packed sequence [context; drafts] with the chain mask. The
        readable reference for `score_block`, which the policy runs (the tests hold them equal).
        """
        b, t, _ = drafts.shape
        pos = torch.arange(1, t + 1, device=drafts.device).expand(b, t)
        x = self.embed(drafts, pos)
        q, k, v = self._qkv(x)
        causal = torch.ones(t, t, dtype=torch.bool, device=drafts.device).tril()[first:]  # [t - first, t]
        mask = torch.cat([ctx_valid.unsqueeze(1).expand(b, t - first, -1), causal.expand(b, -1, -1)], dim=-1)
        k, v = torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)
        return self._finish(x[:, first:], q[:, :, first:], k, v, mask)

    def position_rows(self, cap: int, device: torch.device) -> torch.Tensor:
        """e_1..e_cap as [cap, H] (positions past max_draft reuse the last); zeros without position embeddings."""
        if not self.cfg.use_position:
            return torch.zeros(cap, self.cfg.hidden_size, device=device)
        return self.pos(torch.arange(1, cap + 1, device=device).clamp(max=self.cfg.max_draft))

    def score_block(self, x: torch.Tensor, kv: torch.Tensor, at: int, mask: torch.Tensor) -> torch.Tensor:
        """`score` for one new block, reusing the keys/values of everything before it.

        x: [B, b, H] draft tokens first+1..first+b, embedded (hidden state + e_i, see
        `position_rows`); kv: [2, B, heads, T, d] holding the context and the round's
        earlier drafts in [..., :at, :]; the block's keys/values are written at
        [at, at + b). mask: [B, b, at + b] bool -> logits [B, b].
        """
        x = x.contiguous()  # a batch's block is a strided slice of its round; its reshapes below are views
        qkv = self._qkv(x)  # [3, B, heads, b, d]
        end = at + x.shape[1]
        kv[:, :, :, at:end] = qkv[1:]  # keys and values in one copy
        return self._finish(x, qkv[0], kv[0, :, :, :end], kv[1, :, :, :end], mask)


# -- masks and halting (pure) --


def build_chain_mask(
    context_len: int, starts: list[int], lengths: list[int], window: int | None = None
) -> torch.Tensor:
    """Attention mask of one packed training sequence [context; chain_0; chain_1; ...].

    Chain c starts at context position starts[c] (its round has accepted the
    tokens whose hidden states are context[:starts[c]]) and holds lengths[c]
    draft tokens. Context rows are causal over the context (they carry no
    loss); chain rows see context[max(0, start - window):start] and their own
    chain up to themselves. Returns [T, T] bool, T = context_len + sum(lengths),
    True = may attend.
    """
    total = context_len + sum(lengths)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:context_len, :context_len] = torch.ones(context_len, context_len, dtype=torch.bool).tril()
    row = context_len
    for start, n in zip(starts, lengths):
        lo = 0 if window is None else max(0, start - window)
        mask[row : row + n, lo:start] = True
        mask[row : row + n, row : row + n] = torch.ones(n, n, dtype=torch.bool).tril()
        row += n
    return mask


def go_on(alpha: torch.Tensor, threshold: float, rule: str = "mean") -> torch.Tensor:
    """Pacer's test on one block: alpha [B, b], threshold t (the same for every row) -> go on [B] bool.

    mean: mean(alpha) > t (the paper's choice); any: every alpha >= t; last:
    the block's last alpha >= t. A NaN among the alphas a rule reads means stop.
    """
    if rule == "mean":
        return alpha.mean(-1) > threshold  # comparisons with NaN are False
    if rule == "any":
        return (alpha >= threshold).all(-1)
    if rule == "last":
        return alpha[:, -1] >= threshold
    raise ValueError(f"halting rule must be one of {HALTING}, got {rule!r}")


def halt(alpha: torch.Tensor, threshold: float, rule: str = "mean") -> torch.Tensor:
    """Pacer's halting test: stop [B] bool, the negation of `go_on` (mean(alpha) <= t, some alpha < t,
    last alpha < t; NaN stops)."""
    return ~go_on(alpha, threshold, rule)


def stop_lengths(alpha: torch.Tensor, block: int, threshold: float, growth: float, rule: str = "mean") -> torch.Tensor:
    """Draft lengths the blockwise rule gives whole rounds (offline replay).

    alpha: [B, K] pre-verifier outputs for draft tokens 1..K (each token's
    alpha computed with the earlier ones in view) -> [B] in 1..K: after each
    full block of `block` tokens, stop if the halting rule fires, else
    threshold *= growth (the same for every row still drafting: the j-th
    block of a round is judged at threshold * growth^j). K caps the round.
    """
    n, k = alpha.shape
    length = torch.full((n,), k, dtype=torch.long)
    running = torch.ones(n, dtype=torch.bool)
    for j, end in enumerate(range(block, k, block)):
        stop = halt(alpha[:, end - block : end], threshold * growth**j, rule) & running
        length = torch.where(stop, torch.full_like(length, end), length)
        running &= ~stop
    return length


# -- files --


def save_pacer(path: str | Path, layer: PacerLayer, meta: dict[str, Any]) -> None:
    """meta: draft identity, recommended block_size/threshold/growth, context_window, training summary, commit."""
    doc = {"kind": KIND, "architecture": ARCHITECTURE, **asdict(layer.cfg), **meta}
    save_head_file(path, layer.state_dict(), doc)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _config_from_meta(meta: dict[str, Any], path: str | Path, field: str) -> PacerConfig:
    if meta.get("kind") != KIND or meta.get("architecture") != ARCHITECTURE:
        raise ConfigError(
            f"{field}: {str(path)!r} is a {meta.get('kind')!r}/{meta.get('architecture')!r} head; "
            f"expected {KIND!r}/{ARCHITECTURE!r}"
        )
    sizes = {k: meta.get(k) for k in ("hidden_size", "num_heads", "mlp_size", "max_draft", "context_window")}
    if not all(_int(v) for v in sizes.values()) or sizes["hidden_size"] % sizes["num_heads"]:
        raise ConfigError(f"{field}: {str(path)!r} has bad pre-verifier sizes {sizes}")
    if not isinstance(meta.get("use_position"), bool):
        raise ConfigError(f"{field}: {str(path)!r} has a bad use_position {meta.get('use_position')!r}")
    rec = {k: meta.get(k) for k in ("block_size", "threshold", "growth")}
    ok = (
        _int(rec["block_size"])
        and isinstance(rec["threshold"], (int, float))
        and 0.0 <= rec["threshold"] <= 1.0
        and isinstance(rec["growth"], (int, float))
        and 0.5 <= rec["growth"] <= 2.0
    )
    if not ok:
        raise ConfigError(f"{field}: {str(path)!r} has bad recommended settings {rec}")
    return PacerConfig(
        hidden_size=sizes["hidden_size"],
        num_heads=sizes["num_heads"],
        mlp_size=sizes["mlp_size"],
        max_draft=sizes["max_draft"],
        use_position=meta["use_position"],
        eps=float(meta.get("eps", 1e-6)),
    )


def load_pacer(path: str | Path, field: str = "adaptive_spec.head") -> tuple[PacerLayer, dict[str, Any]]:
    """The layer (float32, CPU, eval mode) and its metadata; ConfigError naming `field` on any defect."""
    return load_head_module(path, field, lambda meta: PacerLayer(_config_from_meta(meta, path, field)))


def check_pacer(path: str | Path, draft_model: str | Path, field: str = "adaptive_spec.head") -> dict[str, Any]:
    """Start-up check: the file is a sound pre-verifier and fits the running draft. Returns its metadata."""
    _, meta = load_pacer(path, field)
    check_draft(meta, path, draft_model, field)
    return meta
