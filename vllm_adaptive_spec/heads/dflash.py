"""A DFlash parallel block drafter in plain PyTorch, computing what vLLM's `dflash` runs.

The inference spec is vLLM 0.32's `DFlashQwen3ForCausalLM` (`qwen3_dflash.py`)
driven by `DFlashProposer` (`v1/spec_decode/dflash.py`). One round, after the
target verified up to position p-1 and emitted x_p:

    c_j    = hidden_norm(fc(cat(h_j[l + 1] for l in target_layer_ids)))   # context state of verified j < p  [H]
    K_j, V_j (layer i) = rope_j(k_norm(k_proj_i(c_j))), v_proj_i(c_j)     # KV injection: c never runs through a layer
    block  = [x_p, m, ..., m] at positions p, p+1, ..., p+K    # m = mask_token_id, K = num_speculative_tokens
    x      = embed(block); each layer a pre-norm Qwen3 decoder layer whose attention
             reads the context keys (j < p) and all K+1 block keys, non-causally
    logits = lm_head(norm(x))[1:]: mask k predicts x_{p+k}, k = 1..K (the anchor's own output is not sampled)

h_j[l + 1] is the target's hidden state after decoder layer l (before the
final norm): vLLM adds 1 to DFlash's `target_layer_ids` and reads its
auxiliary layer ids, whose id k is the output of decoder layer k-1. All K
drafts come from this one forward; nothing feeds a draft back in.

`DFlashDrafter.forward` runs many blocks of one sequence at once (teacher
forcing: every anchor p sees the target's features at j < p, exactly what
vLLM's draft KV cache holds when x_p is the round's bonus token).
`save_hf_dir` writes the directory vLLM loads with
`speculative_config={"method": "dflash", "model": <dir>, "num_speculative_tokens": K}`;
the embedding and LM head are the target's (frozen in training, not shipped:
vLLM shares the target's). Host-free: no vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_adaptive_spec.heads.eagle3 import (
    MLP,
    RMSNorm,
    apply_rope,
    check_attention_shape,
    copy_target_weights,
    draft_hf_config,
    load_weights,
    rope_cos_sin,
    saved_shape,
    shipped_tensors,
    target_shape,
    write_hf_dir,
)

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int  # H: the drafter's width; equals the target's (its embedding and LM head are the target's)
    target_hidden_size: int  # H_t: width of each target hidden state read
    intermediate_size: int  # MLP width
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # d
    vocab_size: int  # V: the target's vocabulary (no draft vocabulary)
    block_size: int = 8  # K: mask positions = drafts per round; vLLM's num_speculative_tokens
    mask_token_id: int = 0  # the token id fed at mask positions (its embedding is the target's)
    target_layer_ids: tuple[int, ...] = (0, 1, 2)  # DFlash ids: the output of decoder layer l (vLLM reads id l + 1)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        check_attention_shape(self.num_heads, self.num_kv_heads, self.head_dim)
        ids = self.target_layer_ids
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"target_layer_ids must be distinct ids >= 0, got {ids}")
        if self.block_size < 1 or self.num_layers < 1:
            raise ValueError(f"block_size and num_layers must be >= 1, got {self.block_size}, {self.num_layers}")

    @classmethod
    def from_target(
        cls,
        target: dict[str, Any],
        block_size: int = 8,
        num_layers: int = 2,
        intermediate_size: int | None = None,
        target_layer_ids: tuple[int, ...] | None = None,
        mask_token_id: int | None = None,
    ) -> DFlashConfig:
        """The drafter for a Qwen3 target config (config.json as a dict): the target's attention
        shape, `num_layers` layers, features of the target's first three layers by default."""
        n = target["num_hidden_layers"]
        if target_layer_ids is None:  # low, middle, high; all below the last layer (see training.dflash)
            target_layer_ids = (0, 1, 2) if n <= 8 else (1, n // 2 - 1, n - 3)
        if mask_token_id is None:  # DFlash checkpoints use a dedicated token; the toy vocabulary has none
            mask_token_id = target.get("pad_token_id") or 0
        return cls(
            **target_shape(target, intermediate_size),
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(target_layer_ids),
        )

    @property
    def fc_in(self) -> int:
        return self.target_hidden_size * len(self.target_layer_ids)

    @property
    def hf_layer_ids(self) -> tuple[int, ...]:
        """Indices into transformers' `output_hidden_states` (= vLLM's auxiliary layer ids)."""
        return tuple(i + 1 for i in self.target_layer_ids)


class Attention(nn.Module):
    """Qwen3 attention (q/k RMS-normed per head, RoPE) over injected context keys plus the block's own."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h = cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        """x [..., T, H] -> [..., heads, T, d]."""
        return proj(x).unflatten(-1, (-1, self.cfg.head_dim)).transpose(-2, -3)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., heads, T, d], positions [..., T]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)  # [..., T, d]
        return apply_rope(x, cos.unsqueeze(-3), sin.unsqueeze(-3))

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, H], positions [..., T] -> k, v [..., nh, T, d]: keys normed and roped, as vLLM caches
        them, and both repeated to the query heads (query head h reads kv head h // (nh / nkv))."""
        k = self._rope(self.k_norm(self._heads(x, self.k_proj)), positions)
        v = self._heads(x, self.v_proj)
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, N, Q, H] (N blocks of Q tokens), positions [B, N, Q]; ctx_k, ctx_v [B, nh, L, d]
        (the sequence's injected context); visible [B, N, L] bool (context keys a block sees).
        Every block token sees the visible context and all Q block tokens (non-causal). -> [B, N, Q, H]."""
        q = self._rope(self.q_norm(self._heads(x, self.q_proj)), positions)  # [B, N, nh, Q, d]
        k, v = self.kv(x, positions)  # [B, N, nh, Q, d]
        scale = self.cfg.head_dim**-0.5
        s_ctx = torch.einsum("bnhqd,bhld->bnhql", q, ctx_k) * scale  # [B, N, nh, Q, L]
        s_ctx = s_ctx.masked_fill(~visible[:, :, None, None, :], float("-inf"))
        s_blk = q @ k.transpose(-1, -2) * scale  # [B, N, nh, Q, Q]
        probs = torch.cat([s_ctx, s_blk], dim=-1).softmax(-1)
        n_ctx = ctx_k.shape[-2]
        o = torch.einsum("bnhql,bhld->bnhqd", probs[..., :n_ctx], ctx_v) + probs[..., n_ctx:] @ v
        return self.o_proj(o.transpose(-2, -3).flatten(-2))  # [B, N, Q, H]


class Layer(nn.Module):
    """Pre-norm Qwen3 decoder layer (the residual stream is the block's; context enters as keys only)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # type: ignore[arg-type]  # reads hidden_size and intermediate_size only

    def forward(self, x, positions, ctx_k, ctx_v, visible) -> torch.Tensor:
        r = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, visible)
        return r + self.mlp(self.post_attention_layernorm(r))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The target's embedding and LM head, frozen: vLLM shares the target's when the checkpoint has none.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.fc_in, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def context(self, aux: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """aux [B, L, fc_in] (the target's layers side by side at positions 0..L-1) -> per layer
        the injected keys and values [B, nh, L, d]."""
        c = self.hidden_norm(self.fc(aux))  # [B, L, H]
        positions = torch.arange(aux.shape[1], device=aux.device).expand(aux.shape[0], -1)
        return [layer.self_attn.kv(c, positions) for layer in self.layers]

    def forward(self, aux: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """One drafting pass for N blocks per sequence.

        aux [B, L, fc_in]; anchors [B, N]: position p of each block's first token,
        anchor_tokens [B, N]: x_p (the token the target emitted there). Block n of
        row b sees the context at positions < p. Returns the normed states of the
        K mask positions [B, N, K, H]; `logits` turns them into drafts for
        x_{p+1}..x_{p+K}.
        """
        cfg = self.cfg
        b, n = anchors.shape
        offsets = torch.arange(cfg.block_size + 1, device=anchors.device)
        positions = anchors[..., None] + offsets  # [B, N, Q]
        masks = torch.full((b, n, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
        x = self.embed_tokens(torch.cat([anchor_tokens[..., None], masks], dim=-1))  # [B, N, Q, H]
        visible = torch.arange(aux.shape[1], device=aux.device) < anchors[..., None]  # [B, N, L]
        for layer, (ctx_k, ctx_v) in zip(self.layers, self.context(aux)):
            x = layer(x, positions, ctx_k, ctx_v, visible)
        return self.norm(x[:, :, 1:])

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)


@torch.no_grad()
def draft_blocks(drafter: DFlashDrafter, ids: torch.Tensor, aux: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Greedy drafts of one sequence, as vLLM drafts the round whose bonus token sits at each anchor.

    ids [L] (x_p at position p), aux [L, fc_in], anchors [N] -> drafts [N, K] for x_{p+1}..x_{p+K}.
    """
    normed = drafter(aux[None], anchors[None], ids[anchors][None])[0]  # [N, K, H]
    return drafter.logits(normed).argmax(-1)


def init_from_target(drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor) -> None:
    """Embedding and LM head (frozen, the target's), final norm from the target's; fc and layers stay random."""
    copy_target_weights(drafter, embed, lm_head, norm)


# -- the directory vLLM loads --

SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, never shipped


def expected_keys(cfg: DFlashConfig) -> set[str]:
    """The tensors a drafter directory must hold: vLLM's DFlash loader leaves missing ones at their
    initial values without a word, so `save_hf_dir` refuses any other set."""
    per_layer = [f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    per_layer += [f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    per_layer += [f"{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")]
    layers = {f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in per_layer}
    return {"fc.weight", "hidden_norm.weight", "norm.weight", *layers}


def hf_config(cfg: DFlashConfig, target_config: dict[str, Any]) -> dict[str, Any]:
    # "DFlashDraftModel" selects qwen3_dflash.py; a Qwen3 name would make vLLM look for DFlashQwen3...
    # Full attention on every layer (layer_types): vLLM then runs the block non-causally, as trained.
    out = draft_hf_config(cfg, target_config, ARCHITECTURE, cfg.num_layers)
    out["dflash_config"] = {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        # DFlash's block counts the anchor; vLLM ignores it (num_speculative_tokens sets the block)
        "block_size": cfg.block_size + 1,
    }
    return out


def save_hf_dir(
    drafter: DFlashDrafter,
    cfg: DFlashConfig,
    out_dir: str | Path,
    target_config: dict[str, Any],
    max_bytes: int = 8_000_000,
) -> Path:
    """Write config.json + model.safetensors (float32; no embed_tokens / lm_head: vLLM shares the target's).

    Deterministic bytes for one set of weights, so a fingerprint of the directory is stable.
    """
    tensors, config = shipped_tensors(drafter, SHARED), hf_config(cfg, target_config)
    return write_hf_dir(Path(out_dir), tensors, expected_keys(cfg), config, "DFlash drafter", max_bytes)


def load_hf_dir(
    path: str | Path, embed: torch.Tensor | None = None, lm_head: torch.Tensor | None = None
) -> tuple[DFlashDrafter, DFlashConfig]:
    """Read a directory `save_hf_dir` wrote; embed and lm_head are the target's (the directory lacks them)."""
    cfg = read_config(path)
    target_tensors = dict(zip(SHARED, (embed, lm_head)))
    return load_weights(DFlashDrafter(cfg), Path(path), target_tensors), cfg


def read_config(path: str | Path) -> DFlashConfig:
    """The drafter's shape from the config.json of a directory `save_hf_dir` wrote."""
    conf = json.loads((Path(path) / "config.json").read_text())
    dflash = conf.get("dflash_config")
    if not isinstance(dflash, dict):
        raise ValueError(f"{str(path)!r} is not a DFlash drafter directory (its config.json has no dflash_config)")
    return DFlashConfig(
        **saved_shape(conf),
        num_layers=conf["num_hidden_layers"],
        block_size=dflash["block_size"] - 1,
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
    )


def parameter_count(drafter: DFlashDrafter) -> int:
    """Shipped parameters (the frozen embedding and LM head are the target's)."""
    return sum(p.numel() for n, p in drafter.named_parameters() if n not in SHARED)
