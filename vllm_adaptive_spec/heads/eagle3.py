"""An EAGLE-3 draft head (Li et al., 2025) in plain PyTorch, computing what vLLM's `eagle3` runs.

The inference spec is vLLM 0.32's `Eagle3Qwen3ForCausalLM` (Qwen3 layout, one
layer, `norm_before_residual` off):

    F      = fc(cat(h1, h2, h3))                    # fused target feature [T, H]
    x      = cat(input_layernorm(embed(tok)), hidden_norm(F))   # [T, 2H]
    a      = o_proj(attn(rope(q_norm(q(x))), rope(k_norm(k(x))), v(x)))
    r      = F + a
    out    = r + mlp(post_attention_layernorm(r))   # "prenorm": the next step's hidden input
    logits = lm_head(norm(out))

At sequence position i the head reads the token x_{i+1} and the target's
feature at i, and predicts x_{i+2}; each later draft step reads the previous
step's prenorm output and the token it drafted, one position further on.

Two forwards share the weights:
- `Eagle3Head.decode`: step by step with an explicit KV cache, as vLLM runs it
  (used to draft and to evaluate).
- `Eagle3Head.forward_ttt`: EAGLE-3's training-time test, S unrolled steps
  over whole sequences at once, with the attention mask that reproduces what
  the inference KV cache holds at each step (see `forward_ttt`).

`save_hf_dir` writes the directory vLLM loads with
`speculative_config={"method": "eagle3", "model": <dir>}`. Host-free: no vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "Eagle3Qwen3ForCausalLM"
# The key-prefix vLLM's loader expects for the single decoder layer.
LAYER = "midlayer"

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # H: the head's width; equals the target's (the embedding is the target's)
    target_hidden_size: int  # H_t: width of each auxiliary target hidden state
    intermediate_size: int  # MLP width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # d
    vocab_size: int  # V: the target's vocabulary; the draft vocabulary is the same (no d2t)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    aux_layer_ids: tuple[int, ...] = (1, 2, 3)  # vLLM layer ids: id k = output of decoder layer k-1

    def __post_init__(self) -> None:
        check_attention_shape(self.num_heads, self.num_kv_heads, self.head_dim)
        if len(set(self.aux_layer_ids)) != len(self.aux_layer_ids) or min(self.aux_layer_ids, default=0) < 1:
            raise ValueError(f"aux_layer_ids must be distinct ids >= 1, got {self.aux_layer_ids}")

    @classmethod
    def from_target(
        cls,
        target: dict[str, Any],
        aux_layer_ids: tuple[int, ...] | None = None,
        intermediate_size: int | None = None,
    ) -> Eagle3Config:
        """The head for a Qwen3 target config (config.json as a dict): same widths (MLP width
        `intermediate_size` if given, else the target's), low/middle/high layers."""
        n = target["num_hidden_layers"]
        if aux_layer_ids is None:  # low, middle, high (vLLM's own default duplicates ids on small targets)
            aux_layer_ids = (2, n // 2, n - 3) if n >= 8 else (1, n // 2, n - 1)
        return cls(**target_shape(target, intermediate_size), aux_layer_ids=tuple(aux_layer_ids))

    @property
    def fc_in(self) -> int:
        return self.target_hidden_size * len(self.aux_layer_ids)


def rope_theta(config: dict[str, Any]) -> float:
    """RoPE base of an HF config (transformers 5 keeps it under `rope_parameters`)."""
    params = config.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"only default RoPE is supported, got rope_type {params['rope_type']!r}")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


# -- what an EAGLE-3 head and a DFlash drafter (heads.dflash) share: shape, config.json, files --


def check_attention_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise ValueError unless the query heads group evenly over the kv heads and head_dim is even."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")


def target_shape(target: dict[str, Any], intermediate_size: int | None = None) -> dict[str, Any]:
    """A draft model's widths, attention shape, norm eps and RoPE base for a Qwen3 target config (as
    config keyword arguments): the target's, MLP width `intermediate_size` if given."""
    hidden = target["hidden_size"]
    return {
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": intermediate_size or target["intermediate_size"],
        "num_heads": target["num_attention_heads"],
        "num_kv_heads": target.get("num_key_value_heads", target["num_attention_heads"]),
        "head_dim": target.get("head_dim") or hidden // target["num_attention_heads"],
        "vocab_size": target["vocab_size"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta(target),
    }


def saved_shape(conf: dict[str, Any]) -> dict[str, Any]:
    """The `target_shape` fields read back from a draft directory's config.json."""
    return {
        "hidden_size": conf["hidden_size"],
        "target_hidden_size": conf["target_hidden_size"],
        "intermediate_size": conf["intermediate_size"],
        "num_heads": conf["num_attention_heads"],
        "num_kv_heads": conf["num_key_value_heads"],
        "head_dim": conf["head_dim"],
        "vocab_size": conf["vocab_size"],
        "rms_norm_eps": conf["rms_norm_eps"],
        "rope_theta": rope_theta(conf),
    }


# -- building blocks --


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., d] (neox layout: the two halves share a frequency)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [..., d/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., d]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos, sin [B, 1, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Qwen3 attention over the 2H-wide [token embedding, hidden] input; q/k RMS-normed per head."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        d, h2 = cfg.head_dim, 2 * cfg.hidden_size
        self.q_proj = nn.Linear(h2, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h2, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h2, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2H], positions [B, T] -> q [B, nh, T, d], k and v [B, nkv, T, d] (k as cached: normed, roped)."""
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, d, self.cfg.rope_theta)  # [B, T, d]
        cos, sin = cos[:, None], sin[:, None]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, nkv, T, d] -> [B, nh, T, d]: query head h reads kv head h // (nh / nkv)."""
        return x.repeat_interleave(self.cfg.num_heads // self.cfg.num_kv_heads, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, nh, T, d] -> [B, T, H]."""
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """The one decoder layer; attention itself is left to the caller (cache or TTT mask)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [B, T, H] -> [B, T, 2H]; the residual stream starts at `hidden` (norm after residual)."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual adds and MLP: [B, T, H] -> the prenorm output [B, T, H]."""
        r = hidden + attn_out
        return r + self.mlp(self.post_attention_layernorm(r))


@dataclass
class KVCache:
    """One drafting batch's attention cache (keys after q/k-norm and RoPE, as vLLM caches them)."""

    k: torch.Tensor  # [B, nkv, Tc, d]
    v: torch.Tensor  # [B, nkv, Tc, d]
    valid: torch.Tensor  # [B, Tc] bool: cached slots that later queries of that row may see


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        # The target's embedding, frozen: vLLM shares the target's when the checkpoint has none.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.fc_in, cfg.hidden_size, bias=False)
        self.midlayer = Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., len(aux_layer_ids) * H_t] (target layers side by side) -> fused feature [..., H]."""
        return self.fc(aux)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)

    # -- inference: one step at a time with a KV cache --

    def decode(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """One drafting pass, as vLLM runs it.

        tokens [B, T] (the token each position consumes), hidden [B, T, H] (the
        fused target feature on the first pass, the previous step's prenorm
        output after it), positions [B, T]. The new tokens see the cache's
        valid slots and each other causally. Returns (normed [B, T, H] for the
        logits, prenorm [B, T, H] for the next step, the cache with the new
        keys appended).
        """
        layer, attn = self.midlayer, self.midlayer.self_attn
        q, k, v = attn.qkv(layer.attn_input(self.embed_tokens(tokens), hidden), positions)
        b, t = tokens.shape
        new_valid = torch.ones(b, t, dtype=torch.bool, device=tokens.device)
        if cache is None:
            cache = KVCache(k, v, new_valid)
        else:
            cache = KVCache(
                torch.cat([cache.k, k], 2), torch.cat([cache.v, v], 2), torch.cat([cache.valid, new_valid], 1)
            )
        tc = cache.k.shape[2]
        causal = torch.ones(t, tc, dtype=torch.bool, device=tokens.device).tril(tc - t)  # [T, Tc]
        mask = causal[None] & cache.valid[:, None, :]  # [B, T, Tc]
        o = F.scaled_dot_product_attention(
            q, attn.expand_kv(cache.k), attn.expand_kv(cache.v), attn_mask=mask[:, None], scale=self.cfg.head_dim**-0.5
        )
        prenorm = layer.finish(hidden, attn.out(o))
        return self.norm(prenorm), prenorm, cache

    # -- training: the training-time test, S steps unrolled over whole sequences --

    def forward_ttt(self, next_tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test. Returns the normed output of each step, [B, T, H] each.

        next_tokens [B, T]: x_{p+1} at position p (ground truth; padding past the end);
        aux [B, T, fc_in]: the target's auxiliary hidden states at p.

        Step 0 reads the fused target feature at p; step s >= 1 at p reads
        step s-1's prenorm output at p-1 (the state vLLM feeds forward) and
        embed(x_{p+1}), and sits at RoPE position p. Its query sees exactly
        what the inference cache holds for a chain started at c = p - s: the
        step-0 keys at positions <= c, and step k's key at c + k for k = 1..s
        (one diagonal per earlier step). Rows with p < s have no such chain;
        their outputs are finite but meaningless (mask them out of the loss).
        """
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, t = next_tokens.shape
        scale = self.cfg.head_dim**-0.5
        positions = torch.arange(t, device=next_tokens.device).expand(b, t)
        embeds = self.embed_tokens(next_tokens)  # [B, T, H]
        idx = torch.arange(t, device=next_tokens.device)
        hidden = self.fuse(aux)  # [B, T, H]
        keys: list[torch.Tensor] = []  # step k's keys and values, [B, nh, T, d] each
        values: list[torch.Tensor] = []
        outputs = []
        for s in range(steps):
            q, k, v = attn.qkv(layer.attn_input(embeds, hidden), positions)
            keys.append(attn.expand_kv(k))
            values.append(attn.expand_kv(v))
            # the step-0 block: causal, shifted s back
            scores = [q @ keys[0].transpose(-1, -2) * scale]  # [B, nh, T, T]
            blocked = idx[None, :] > idx[:, None] - s  # [T, T] key j hidden from query p when j > p - s
            scores[0] = scores[0].masked_fill(blocked, float("-inf"))
            # one diagonal per later step: step k's key at p - s + k
            shifted_v = []
            for k_step in range(1, s + 1):
                key, val = shift(keys[k_step], s - k_step), shift(values[k_step], s - k_step)
                scores.append((q * key).sum(-1, keepdim=True) * scale)  # [B, nh, T, 1]
                shifted_v.append(val)
            probs = torch.cat(scores, -1).softmax(-1)  # [B, nh, T, T + s]
            o = probs[..., :t] @ values[0]
            for i, val in enumerate(shifted_v):
                o = o + probs[..., t + i : t + i + 1] * val
            prenorm = layer.finish(hidden, attn.out(o))
            outputs.append(self.norm(prenorm))
            hidden = shift(prenorm, 1, dim=1)  # step s+1 at p reads step s at p-1
        return outputs


@torch.no_grad()
def draft_chains(
    head: Eagle3Head,
    next_tokens: torch.Tensor,
    aux: torch.Tensor,
    starts: torch.Tensor,
    length: int,
    with_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Greedy chains, each drafted as vLLM drafts a round: tokens [C, length].

    next_tokens [T] (x_{p+1} at position p), aux [T, fc_in]; a chain starting
    at c begins after the target produced x_{c+1}: its first pass sees the
    target's features at positions <= c, and it drafts x_{c+2}, x_{c+3}, ...
    All chains share one first pass; each then masks the cache to its prefix.
    with_states: also the normed state each draft's logits came from, [C, length, H]
    (what the adaptive loop hands a stopping policy at that step).
    """
    t, c = next_tokens.shape[0], starts
    positions = torch.arange(t)
    normed, prenorm, cache = head.decode(next_tokens[None], head.fuse(aux)[None], positions[None])
    n = len(c)
    cache = KVCache(cache.k.expand(n, -1, -1, -1), cache.v.expand(n, -1, -1, -1), positions[None, :] <= c[:, None])
    state, hidden = normed[0, c], prenorm[0, c]  # [C, H] each
    token = head.logits(state).argmax(-1)  # [C]
    drafted, states = [token], [state]
    for k in range(1, length):
        normed, hidden, cache = head.decode(token[:, None], hidden[:, None], (c + k)[:, None], cache)
        state, hidden = normed[:, 0], hidden[:, 0]
        token = head.logits(state).argmax(-1)
        drafted.append(token)
        states.append(state)
    tokens = torch.stack(drafted, 1)
    return (tokens, torch.stack(states, 1)) if with_states else tokens


def shift(x: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
    """Move x n places forward along `dim` (the sequence axis), zero-filling the front."""
    if n == 0:
        return x
    front = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([front, x.narrow(dim, 0, x.shape[dim] - n)], dim)


def copy_target_weights(model: nn.Module, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor) -> None:
    """Copy the target's embedding, LM head and final norm into a draft model's own."""
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
        model.norm.weight.copy_(norm)


def init_from_target(head: Eagle3Head, embed: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor) -> None:
    """Embedding (frozen), LM head and final norm copied from the target; fc and the layer stay random."""
    copy_target_weights(head, embed, lm_head, norm)


# -- the directory vLLM loads --

SHARED = ("embed_tokens.weight",)  # the target's, never shipped

# Qwen3 fields copied from the target's config (the decoder layer reads them).
_COPIED = (
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "hidden_act",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
)


def expected_keys(cfg: Eagle3Config) -> set[str]:
    """The tensors a head directory must hold (vLLM loads missing ones silently as garbage)."""
    attn = [f"{LAYER}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    mlp = [f"{LAYER}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [f"{LAYER}.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    return {"fc.weight", "norm.weight", "lm_head.weight", *attn, *mlp, *norms}


def draft_hf_config(cfg: Any, target_config: dict[str, Any], architecture: str, num_layers: int) -> dict[str, Any]:
    """The Qwen3 config.json fields of a draft directory (cfg: an Eagle3Config or a DFlashConfig)."""
    out = {k: target_config[k] for k in _COPIED if k in target_config}
    out.update(
        {
            "architectures": [architecture],
            "model_type": "qwen3",
            "dtype": "float32",
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps,
            "vocab_size": cfg.vocab_size,
            "num_hidden_layers": num_layers,
            "layer_types": ["full_attention"] * num_layers,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "target_hidden_size": cfg.target_hidden_size,
            "draft_vocab_size": cfg.vocab_size,
        }
    )
    if "rope_parameters" not in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return out


def hf_config(cfg: Eagle3Config, target_config: dict[str, Any]) -> dict[str, Any]:
    out = draft_hf_config(cfg, target_config, ARCHITECTURE, num_layers=1)
    # vLLM's default for a 4-layer target is (2, 2, 1): a duplicate, and a shape error at run time.
    out["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return out


def shipped_tensors(model: nn.Module, shared: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The model's state dict in float32 on the CPU, less the `shared` tensors (vLLM uses the target's)."""
    return {
        name: t.detach().to(torch.float32).contiguous().cpu()
        for name, t in model.state_dict().items()
        if name not in shared
    }


def write_hf_dir(
    out_dir: Path, tensors: dict[str, torch.Tensor], want: set[str], config: dict[str, Any], what: str, max_bytes: int
) -> Path:
    """Refuse tensors other than `want` or over max_bytes; else write config.json + model.safetensors.

    Deterministic bytes for one set of weights, so a fingerprint of the directory is stable.
    """
    from safetensors.torch import save_file

    if set(tensors) != want:
        raise AssertionError(f"{what} keys {sorted(set(tensors) ^ want)} differ from what vLLM loads")
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > max_bytes:
        raise ValueError(f"{what} is {size / 1e6:.2f} MB in float32; the limit is {max_bytes / 1e6:.2f} MB")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(dict(sorted(tensors.items())), str(out_dir / "model.safetensors"), {"format": "pt"})
    return out_dir


def load_weights(model: M, path: Path, target_tensors: dict[str, torch.Tensor | None]) -> M:
    """path/model.safetensors plus the target's tensors given into model (only those may be missing); frozen."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({name: value for name, value in target_tensors.items() if value is not None})
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - set(target_tensors):
        raise ValueError(f"{path}: missing {missing}, unexpected {unexpected}")
    return model.eval().requires_grad_(False)


def save_hf_dir(
    head: Eagle3Head,
    cfg: Eagle3Config,
    out_dir: str | Path,
    target_config: dict[str, Any],
    max_bytes: int = 10_000_000,
) -> Path:
    """Write config.json + model.safetensors (float32; no embed_tokens: vLLM shares the target's).

    Deterministic bytes for one set of weights, so the plugin's fingerprint
    of the directory is stable.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(cfg, target_config)
    return write_hf_dir(out_dir, shipped_tensors(head, SHARED), expected_keys(cfg), config, "EAGLE-3 head", max_bytes)


def load_hf_dir(path: str | Path, embed: torch.Tensor | None = None) -> tuple[Eagle3Head, Eagle3Config]:
    """Read a directory `save_hf_dir` wrote (embed: the target's embedding, which the directory lacks)."""
    path = Path(path)
    conf = json.loads((path / "config.json").read_text())
    cfg = Eagle3Config(**saved_shape(conf), aux_layer_ids=tuple(conf["eagle_aux_hidden_state_layer_ids"]))
    return load_weights(Eagle3Head(cfg), path, {"embed_tokens.weight": embed}), cfg


def parameter_count(head: Eagle3Head) -> int:
    """Shipped parameters (the frozen embedding is the target's)."""
    return sum(p.numel() for n, p in head.named_parameters() if n not in SHARED)
