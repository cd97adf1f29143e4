"""SpecDec++ acceptance head (seed 001; ALGORITHMS.md, "SpecDec++ acceptance head").

f: D residual blocks x <- x + SiLU(W_l x + b_l), each with its own weights
(the public code reused one module D times by mistake), then Linear(H, 1).
p_t = sigmoid(f(h_t)) estimates P(y_t accepted | prefix), h_t being the
draft's final hidden state at the position that consumes y_t. Drafting stops
after y_t once 1 - prod_{j<=t} p_j > theta.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_adaptive_spec.errors import ConfigError
from vllm_adaptive_spec.heads.fileformat import check_draft, load_head_module, save_head_file

KIND = "specdecpp"
ARCHITECTURE = "residual-silu-mlp"


@dataclass(frozen=True)
class SpecDecHeadConfig:
    hidden_size: int  # the draft's hidden size H
    depth: int = 3  # residual blocks D (the paper's robust choice)


class SpecDecHead(nn.Module):
    def __init__(self, cfg: SpecDecHeadConfig):
        super().__init__()
        self.cfg = cfg
        # One Linear per block: a list comprehension, never [block] * D.
        self.blocks = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.depth))
        self.out = nn.Linear(cfg.hidden_size, 1)
        for block in self.blocks:
            # Blocks start near the identity, so the untrained head is a linear probe.
            nn.init.normal_(block.weight, std=0.02)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] -> acceptance logits [...]."""
        x = hidden
        for block in self.blocks:
            x = x + nn.functional.silu(block(x))
        return self.out(x).squeeze(-1)

    def inference(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """This forward for inference on the current device and weights (`frozen_logits`)."""
        return frozen_logits(self)


def frozen_logits(head: SpecDecHead) -> Callable[[torch.Tensor], torch.Tensor]:
    """`head`'s forward for inference on its current device and weights: hidden [B, H] -> acceptance
    logits [B]. The same maths as `forward` in as few tensor ops as it takes (inside the engine each
    op costs about 10 us run cold after the draft forward): `addmm` on stored W^T (far cheaper than
    `F.linear` on CPU at a few rows, see heads.affine) and the output map as one `addmv`."""
    blocks = [(block.weight.detach().t().contiguous(), block.bias.detach()) for block in head.blocks]  # W^T, b
    w_out, b_out = head.out.weight.detach()[0].contiguous(), head.out.bias.detach()  # [H], [1]

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        x = hidden  # [B, H]
        for wt, b in blocks:
            x = x + nn.functional.silu(torch.addmm(b, x, wt))
        return torch.addmv(b_out, x, w_out)  # [B]

    return logits


def stop_rule(running: torch.Tensor, p: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the SpecDec++ rule.

    running: [B] prod_{j<t} p_j; p: [B] p_t -> (running * p_t [B], go [B] bool),
    go = not (1 - prod_{j<=t} p_j > threshold), written prod >= 1 - threshold (one op, not three;
    `stop_lengths` compares the same way). NaN in p means not go.
    """
    running = running * p  # [B]
    return running, running >= 1.0 - threshold  # NaN -> False


def stop_lengths(p: torch.Tensor, threshold: float) -> torch.Tensor:
    """Draft lengths the rule gives a whole round at once (offline replay).

    p: [B, K] acceptance probabilities of draft tokens 0..K-1 -> [B] in 1..K:
    the first t >= 1 with 1 - prod_{j<t} p_j > threshold, else K. Token 0 is
    always drafted: nothing is known about it before it exists.
    """
    k = p.shape[-1]
    go = torch.cumprod(p[:, : k - 1], dim=-1) >= 1.0 - threshold  # [B, K-1]: risk after token j within bounds
    stop_after = torch.cat([~go, torch.ones_like(p[:, :1], dtype=torch.bool)], -1)  # [B, K]
    return stop_after.int().argmax(-1) + 1  # first True; NaN risk -> stop


def save_specdecpp(path: str | Path, head: SpecDecHead, meta: dict[str, Any]) -> None:
    """meta: draft identity, recommended_threshold, training summary, commit..."""
    doc = {"kind": KIND, "architecture": ARCHITECTURE, **asdict(head.cfg), **meta}
    save_head_file(path, head.state_dict(), doc)


def _config_from_meta(meta: dict[str, Any], path: str | Path, field: str) -> SpecDecHeadConfig:
    if meta.get("kind") != KIND or meta.get("architecture") != ARCHITECTURE:
        raise ConfigError(
            f"{field}: {str(path)!r} is a {meta.get('kind')!r}/{meta.get('architecture')!r} head; "
            f"expected {KIND!r}/{ARCHITECTURE!r}"
        )
    sizes = {k: meta.get(k) for k in ("hidden_size", "depth")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes.values()):
        raise ConfigError(f"{field}: {str(path)!r} has bad head sizes {sizes}")
    threshold = meta.get("recommended_threshold")
    if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"{field}: {str(path)!r} has a bad recommended_threshold {threshold!r}")
    return SpecDecHeadConfig(**sizes)


def load_specdecpp(path: str | Path, field: str = "adaptive_spec.head") -> tuple[SpecDecHead, dict[str, Any]]:
    """The head (float32, CPU, eval mode) and its metadata; ConfigError naming `field` on any defect."""
    return load_head_module(path, field, lambda meta: SpecDecHead(_config_from_meta(meta, path, field)))


def check_specdecpp(path: str | Path, draft_model: str | Path, field: str = "adaptive_spec.head") -> dict[str, Any]:
    """Start-up check: the file is a sound head and fits the running draft. Returns its metadata."""
    head, meta = load_specdecpp(path, field)
    check_draft(meta, path, draft_model, field)
    return meta
