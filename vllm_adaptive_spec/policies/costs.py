"""Step cost curves: what a draft step and a target pass cost at each size, measured on the machine.

A cost file is JSON: {"draft_step_ms": [[requests, ms], ...], "verify_ms": [[tokens, ms], ...]},
one draft forward of the whole batch per request count, one target pass (with sampling and the
engine's bookkeeping) per token count. `python -m benchmarks.step_costs` measures them through
vLLM. Sizes between points interpolate linearly, past the last two extrapolate linearly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from vllm_adaptive_spec.errors import ConfigError

FIELD = "adaptive_spec.costs"

# Measured on the 2-core CPU with the bundled toy pair (vLLM's bfloat16), 2026-11-23:
# `python -m benchmarks.step_costs` (benchmarks/results/step_costs/costs.json, rounded).
DEFAULT_COSTS: dict[str, list[list[float]]] = {
    "draft_step_ms": [[1, 1.16], [2, 1.63], [4, 1.47], [8, 1.94], [16, 2.59], [32, 3.9]],
    "verify_ms": [
        [1, 6.22],
        [2, 7.0],
        [4, 6.88],
        [8, 8.06],
        [8.1, 7.52],
        [14.6, 10.17],
        [16, 9.02],
        [26.5, 9.75],
        [32, 10.73],
        [38.6, 12.94],
        [68.5, 18.06],
        [143.2, 31.37],
    ],
}


def load_costs(path: str | None) -> dict[str, list[list[float]]]:
    """The curves of a cost file (None: DEFAULT_COSTS); a bad file raises ConfigError naming the field."""
    if path is None:
        return DEFAULT_COSTS
    try:
        doc = json.loads(Path(path).read_text())
        curves = {k: [[float(x), float(y)] for x, y in doc[k]] for k in ("draft_step_ms", "verify_ms")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{FIELD}: {str(path)!r} is not a cost file with draft_step_ms and verify_ms curves "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    for k, pts in curves.items():
        if not pts or any(not (x >= 1 and math.isfinite(x) and y >= 0 and math.isfinite(y)) for x, y in pts):
            raise ConfigError(f"{FIELD}: {str(path)!r}: {k} needs [size >= 1, ms >= 0] points, got {pts}")
    return curves


def curve(points: list, sizes: torch.Tensor) -> torch.Tensor:
    """Cost at each size: piecewise linear through the (made non-decreasing) points, linear past the
    last two, the first point's cost below it. sizes: [N] -> [N] float64 (CPU)."""
    pts = sorted(points)
    xs = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    ys = torch.cummax(torch.tensor([p[1] for p in pts], dtype=torch.float64), dim=0).values
    s = sizes.double().cpu()
    if len(xs) == 1:
        return ys.expand_as(s).clone()
    idx = torch.searchsorted(xs, s).clamp(1, len(xs) - 1)
    x0, x1, y0, y1 = xs[idx - 1], xs[idx], ys[idx - 1], ys[idx]
    out = y0 + (y1 - y0) * (s - x0) / (x1 - x0).clamp_min(1e-12)
    return torch.where(s < xs[0], ys[0], out).clamp_min(1e-6)


class StepCosts:
    """draft(n): one draft step of n requests; verify(x): a target pass over x tokens (ms), cached per n."""

    def __init__(self, curves: dict[str, list[list[float]]]):
        self.curves = curves
        self._verify: dict[int, torch.Tensor] = {}
        self._draft: dict[int, float] = {}
        self._verify_list: dict[int, list[float]] = {}

    def draft(self, n_rows: int) -> float:
        if n_rows not in self._draft:
            self._draft[n_rows] = float(curve(self.curves["draft_step_ms"], torch.tensor([n_rows]))[0])
        return self._draft[n_rows]

    def verify_table(self, max_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[max_tokens + 1]: the cost of a pass over 0..max_tokens tokens, float32 on `device`."""
        key = max_tokens
        if key not in self._verify or self._verify[key].device != torch.device(device):
            self._verify[key] = curve(self.curves["verify_ms"], torch.arange(max_tokens + 1)).float().to(device)
        return self._verify[key]

    def verify_list(self, max_tokens: int) -> list[float]:
        """`verify_table` as a host list, for the gate's arithmetic."""
        if max_tokens not in self._verify_list:
            self._verify_list[max_tokens] = self.verify_table(max_tokens).tolist()
        return self._verify_list[max_tokens]
