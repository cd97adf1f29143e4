"""What one MLP layer of the regime's target costs per pass over M tokens, on vLLM's CPU GEMM.

    .venv/bin/python -m benchmarks.gemm_curve [--factor 32] [--out benchmarks/results/gemm_curve]

A batch-1 verification pass runs the target over 1 + m tokens (m drafts). The step-cost model of the
harness prices a pass as affine in its tokens; this times the GEMMs that dominate the cost-scaled
target (regime (b)/(c): MLP x32, hidden 256, intermediate 768 x factor, bfloat16) through the kernel
vLLM picks on this CPU (`vllm._custom_ops.onednn_mm` with a prepacked weight, as
`dispatch_cpu_unquantized_gemm` does without AMX), one thread (the engine's), on random weights of the
layer's shapes. Token counts M = 1..8 take turns (order reversed every other round), medians and
quartiles over rounds. Run it pinned to one core (`taskset -c 0`) on an otherwise idle machine; writes
gemm_curve.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.paths import REPO

HIDDEN, INTERMEDIATE = 256, 768  # the bundled toy target's
TOKENS = tuple(range(1, 9))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factor", type=int, default=32, help="the scaled copy's MLP factor")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gemm_curve")
    args = ap.parse_args()
    import vllm._custom_ops as ops

    torch.set_num_threads(1)
    torch.manual_seed(0)
    inter = INTERMEDIATE * args.factor
    up = ops.create_onednn_mm((torch.randn(2 * inter, HIDDEN) * 0.02).to(torch.bfloat16).t(), 32)  # gate + up
    down = ops.create_onednn_mm((torch.randn(HIDDEN, inter) * 0.02).to(torch.bfloat16).t(), 32)
    xs = {m: torch.randn(m, HIDDEN).to(torch.bfloat16) for m in TOKENS}  # [M, hidden]
    hs = {m: torch.randn(m, inter).to(torch.bfloat16) for m in TOKENS}  # [M, intermediate]

    def layer(m: int) -> None:
        ops.onednn_mm(up, xs[m], None)
        ops.onednn_mm(down, hs[m], None)

    for m in TOKENS:  # warm every shape's primitive first
        for _ in range(10):
            layer(m)
    times: dict[int, list[float]] = {m: [] for m in TOKENS}
    for r in range(args.rounds):
        for m in TOKENS if r % 2 == 0 else TOKENS[::-1]:
            start = time.perf_counter()
            for _ in range(5):
                layer(m)
            times[m].append((time.perf_counter() - start) / 5 * 1e6)
    out = {
        "what": f"one MLP layer (gate+up and down GEMMs), intermediate {inter}, bfloat16, onednn_mm, 1 thread",
        "us_median": {m: round(statistics.median(v)) for m, v in times.items()},
        "us_quartiles": {m: [round(q) for q in statistics.quantiles(v, n=4)[::2]] for m, v in times.items()},
        "rounds": args.rounds,
    }
    print(json.dumps(out, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_curve.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
