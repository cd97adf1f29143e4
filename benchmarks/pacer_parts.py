"""Where the Pacer layer's time goes inside vLLM: its parts, timed in the engine at batch 1.

    .venv/bin/python -m benchmarks.pacer_parts [--drafter eagle3] [--n-prompts 16] [--max-tokens 64]

One engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the worker's policy runs here), the
bundled Pacer layer of `--drafter` (cap K=16, gate off, max_num_seqs=1), held-out code prompts, greedy.
Each call of the policy and each of the layer's linear maps is timed with perf_counter (no sync is
needed on CPU); "attention and the rest" is a block's time less its linear maps. Prints and saves
microseconds per call and per draft step: what each part costs, run cold after the draft forward.

`--micro`: no engine; the block's qkv product ([2, 256] x [256, 768], float32 and bfloat16) timed hot
and with the caches flushed before each call (a 64 MB write), medians of 200 calls.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

from benchmarks.paths import REPO, load_prompts


def _timed(fn, key, totals, calls):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        name = key(*args, **kwargs)
        totals[name] += time.perf_counter() - start
        calls[name] += 1
        return out

    return wrapper


def micro() -> dict:
    """The qkv product of a block of 2 at the EAGLE-3 head's width, hot and cold (us, medians)."""
    import statistics

    import torch

    x, wt = torch.randn(2, 256), torch.randn(256, 768)
    flush = torch.empty(16 * 1024 * 1024)  # 64 MB: more than this CPU's caches
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = x.to(dtype), wt.to(dtype)
        for cold in (False, True):
            times = []
            for _ in range(200):
                if cold:
                    flush.fill_(1.0)
                start = time.perf_counter()
                torch.mm(a, b)
                times.append(time.perf_counter() - start)
            out[f"{str(dtype).split('.')[-1]} {'cold' if cold else 'hot'}"] = round(1e6 * statistics.median(times), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="eagle3", choices=("draft_model", "eagle3"))
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pacer_parts_b1"))
    ap.add_argument("--micro", action="store_true", help="time the qkv product alone, hot and cold")
    args = ap.parse_args()
    if args.micro:
        got = micro()
        print(got)
        with open(f"{args.out}/qkv-product-micro.json", "w") as fh:
            json.dump({"shape": "[2, 256] x [256, 768]", "us_median": got}, fh, indent=1)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: the worker in this process

    from benchmarks import vllm_run
    from benchmarks.harness.plan import EAGLE3_PACER_HEAD, PACER_HEAD
    from vllm_adaptive_spec.heads.pacer import PacerLayer
    from vllm_adaptive_spec.policies.pacer import PacerPolicy

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for method in ("round_limits", "observe_context", "end_round"):
        setattr(PacerPolicy, method, _timed(getattr(PacerPolicy, method), lambda *a, m=method, **k: m, totals, calls))

    def step_kind(self, logp, tokens, t, hidden=None):
        return "decide, block" if t and t % self.block == 0 else "decide, no block"

    PacerPolicy.decide = _timed(PacerPolicy.decide, step_kind, totals, calls)
    PacerLayer._linear = _timed(PacerLayer._linear, lambda self, name, *a, **k: f"linear {name}", totals, calls)
    PacerLayer.score_block = _timed(PacerLayer.score_block, lambda *a, **k: "score_block", totals, calls)

    head = EAGLE3_PACER_HEAD if args.drafter == "eagle3" else PACER_HEAD
    adaptive = {"policy": "pacer", "head": str(head), "batch_aware": False}
    llm = vllm_run.make_llm(16, adaptive, method=args.drafter, max_num_seqs=1)
    try:
        params = vllm_run.greedy_params(args.max_tokens)
        llm.generate(load_prompts("code_heldout", 1), params, use_tqdm=False)  # warm-up
        totals.clear(), calls.clear()
        llm.generate(load_prompts("code_heldout", args.n_prompts), params, use_tqdm=False)
    finally:
        vllm_run.close_llm(llm)
    steps = calls["decide, block"] + calls["decide, no block"]
    block_linears = sum(v for k, v in totals.items() if k.startswith("linear ") and k != "linear kv")
    totals["score_block: attention and the rest"] = totals["score_block"] - block_linears
    calls["score_block: attention and the rest"] = calls["score_block"]
    rows = {
        k: {
            "calls": calls[k],
            "us_per_call": round(1e6 * totals[k] / calls[k], 1),
            "us_per_draft_step": round(1e6 * totals[k] / steps, 1),
        }
        for k in sorted(totals)
        if calls[k]
    }
    policy_calls = ("round_limits", "observe_context", "end_round", "decide, block", "decide, no block")
    per_step = round(1e6 * sum(totals[k] for k in policy_calls) / steps, 1)
    for k, row in rows.items():
        print(f"{k:38s} {row['calls']:6d} calls {row['us_per_call']:8.1f} us/call", end="")
        print(f" {row['us_per_draft_step']:7.1f} us/step")
    print(f"the policy in all: {per_step} us per draft step over {steps} draft steps")
    out = f"{args.out}/{args.drafter}-pacer-parts.json"
    with open(out, "w") as fh:
        json.dump({**vars(args), "draft_steps": steps, "policy_us_per_step": per_step, "parts": rows}, fh, indent=1)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
