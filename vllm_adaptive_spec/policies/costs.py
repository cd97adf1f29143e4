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


def non_decreasing(points: list[tuple[float, float, int]]) -> list[float]:
    """The weighted least-squares non-decreasing fit (pool adjacent violators) of (size, y, weight)
    points sorted by size -> the fitted y per point."""
    blocks: list[list[float]] = []  # [mean y, weight, points pooled]
    for _, y, w in points:
        blocks.append([y, float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            y2, w2, n2 = blocks.pop()
            y1, w1, n1 = blocks[-1]
            blocks[-1] = [(y1 * w1 + y2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [y for y, _, n in blocks for _ in range(int(n))]


class CostMeter:
    """The cost curves of the machine the loop runs on, measured by the loop itself (`costs: "online"`).

    The loop reports each round's draft side (ms per draft forward at n rows) and the time between
    rounds (one target pass over x tokens, with sampling and the engine's bookkeeping), the same
    quantities `benchmarks.step_costs` measures. Samples go to buckets of similar size (exact sizes up
    to 16, then a quarter octave wide), the last `window` per bucket. `curves()` puts a point at
    each bucket with at least `min_samples` (mean size, upper median ms, made non-decreasing: `measured`)
    and keeps the prior's shape elsewhere, scaled by the median ratio of measured to prior cost over
    the measured buckets (of that curve, else of the other one).
    """

    KINDS = ("draft_step_ms", "verify_ms")

    def __init__(self, prior: dict[str, list[list[float]]], window: int = 32, min_samples: int = 4):
        self.prior, self.window, self.min_samples = prior, window, min_samples
        self._buckets: dict[str, dict[int, tuple[list[float], list[float]]]] = {k: {} for k in self.KINDS}
        self.samples = 0

    @staticmethod
    def _bucket(size: float) -> int:
        return int(size) if size <= 16 else 17 + math.floor(4 * math.log2(size / 16))

    def add(self, kind: str, size: float, ms: float) -> None:
        """One measurement: `kind` one of KINDS, size >= 1 (rows or tokens), ms >= 0."""
        if not (size >= 1 and ms >= 0 and math.isfinite(ms)):
            return
        sizes, times = self._buckets[kind].setdefault(self._bucket(size), ([], []))
        sizes.append(float(size))
        times.append(float(ms))
        if len(times) > self.window:
            del sizes[0], times[0]
        self.samples += 1

    def measured(self, kind: str) -> list[list[float]]:
        """[[mean size, ms], ...] of the buckets with enough samples, by size: each bucket's upper
        median, made non-decreasing by pooling neighbours that are not (weighted by their samples).
        A bucket that came out slow between two fast ones is averaged with them: `curve`'s running
        maximum would instead price every size up to it as slow, a flat stretch where the next
        tokens look free."""
        pts = []
        for sizes, times in self._buckets[kind].values():
            if len(times) >= self.min_samples:
                pts.append((sum(sizes) / len(sizes), sorted(times)[len(times) // 2], len(times)))
        pts.sort()
        return [[x, y] for (x, _, _), y in zip(pts, non_decreasing(pts))]

    def curves(self) -> dict[str, list[list[float]]]:
        measured = {k: self.measured(k) for k in self.KINDS}
        ratios = {}
        for k, pts in measured.items():
            if pts:
                prior = curve(self.prior[k], torch.tensor([x for x, _ in pts]))  # [P]
                r = sorted(y / float(p) for (_, y), p in zip(pts, prior))
                ratios[k] = r[len(r) // 2]
        out = {}
        for k, pts in measured.items():
            other = [r for kk, r in ratios.items() if kk != k]
            scale = ratios.get(k, other[0] if other else 1.0)
            lo, hi = (pts[0][0], pts[-1][0]) if pts else (math.inf, -math.inf)
            kept = [[x, y * scale] for x, y in self.prior[k] if not lo <= x <= hi]  # the prior outside the data
            out[k] = sorted(pts + kept)
        return out
