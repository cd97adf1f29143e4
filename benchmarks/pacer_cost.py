"""Cost of the Pacer pre-verifier per call, as the policy runs it (one CPU thread).

    .venv/bin/python -m benchmarks.pacer_cost --head heads/toy/pacer.safetensors

Times, at batch sizes 1 and 16, the once-per-round context keys/values over a
full window and one block judgement (`PacerLayer.score` on the block's tokens
plus the halting rule) after 4, 8, 12 and 16 draft tokens; median of repeats.
Writes JSON next to the head (`<stem>.cost.json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vllm_adaptive_spec.heads.pacer import halt, load_pacer


def _median_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


@torch.no_grad()
def measure(head: Path, repeats: int = 300) -> dict:
    layer, meta = load_pacer(head)
    h, w, b = layer.cfg.hidden_size, min(int(meta["context_window"]), 1024), int(meta["block_size"])
    out: dict = {"head": str(head), "threads": torch.get_num_threads(), "window": w, "block_size": b, "rows": []}
    for batch in (1, 16):
        ctx = torch.randn(batch, w, h)
        valid = torch.ones(batch, w, dtype=torch.bool)
        kv = layer.context_kv(ctx)
        thr = torch.full((batch,), 0.7)
        row = {"batch": batch, "context_kv_us": _median_us(lambda ctx=ctx: layer.context_kv(ctx), repeats)}
        for t in (4, 8, 12, 16):
            drafts = torch.randn(batch, t, h)

            def judge(kv=kv, valid=valid, drafts=drafts, t=t, thr=thr):
                halt(torch.sigmoid(layer.score(kv, valid, drafts, t - b)), thr, "mean")

            row[f"judge_t{t}_us"] = _median_us(judge, repeats)
        out["rows"].append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=Path("heads/toy/pacer.safetensors"))
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = measure(args.head, args.repeats)
    path = args.head.with_name(args.head.name.removesuffix(".safetensors") + ".cost.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
