"""CUDA graphs for the small stopping heads (host-free).

On a GPU a small head costs its kernel launches, not its arithmetic: at batch 1 on an H100 the
SpecDec++ head's forward took 140-210 us eagerly whatever its width (4096 or 256;
benchmarks/results/gpu_costs_h100), against a 0.5 ms EAGLE-3 draft step of an 8B target. So on
CUDA a head's forward is captured once per bucket of rows (powers of two) and replayed: one launch
per draft step. Elsewhere the head runs as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")


def bucket(n: int) -> int:
    """The power of two a graph is captured for that covers n (n >= 1; 1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def capture(fn: Callable[[], T], device: torch.device) -> Callable[[], T]:
    """fn reads and writes only static tensors on `device` (CUDA); returns a replay of its kernels that
    returns fn's (static) outputs. Warmed up on a side stream first, as CUDA graph capture needs."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads' CUDA calls stay legal
        out = fn()

    def replay() -> T:
        graph.replay()
        return out

    return replay


class RowGraphs:
    """`fn`: x [B, width] -> y [B, ...], replayed from one captured graph per bucket of rows (the next
    power of two; the bucket's extra rows hold stale inputs, their outputs are cut off). The output is
    the graph's own tensor: read it before the next call. If a capture fails, `fn` runs eagerly from
    then on (logged once)."""

    def __init__(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        capture: Callable[[Callable[[], torch.Tensor], torch.device], Callable[[], torch.Tensor]] = capture,
    ):
        self.fn, self.width, self.dtype, self.device, self._capture = fn, width, dtype, device, capture
        self._graphs: dict[int, tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}  # bucket -> input, replay
        self.eager = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.eager:
            return self.fn(x)
        b = x.shape[0]
        rows = bucket(b)
        if rows not in self._graphs:
            inp = torch.zeros(rows, self.width, dtype=self.dtype, device=self.device)
            try:
                self._graphs[rows] = (inp, self._capture(lambda: self.fn(inp), self.device))
            except RuntimeError as exc:
                logger.warning("adaptive_spec: a stopping head's CUDA graph failed (%s); it runs eagerly", exc)
                self.eager = True
                return self.fn(x)
        inp, replay = self._graphs[rows]
        inp[:b].copy_(x)
        return replay()[:b]
