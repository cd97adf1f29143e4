"""Measure the cost curves vllm_av chooses its verification budget from, on this machine.

    .venv/bin/python -m benchmarks.step_costs [--out benchmarks/results/step_costs]
    .venv/bin/python -m benchmarks.step_costs --method eagle3 --target-mlp-factor 32 \
        --out benchmarks/results/step_costs_eagle3_target-mlp32      # a regime's own curves
    ... --batch1-ks 2,4,16     # more points on the batch-1 verify curve (one engine per cap)

Two engines on the bundled pair (greedy, code prompts, `ignore_eos`, 96 tokens):
- no speculation at batch n: every engine step is one target pass over n tokens;
- the plugin's `fixed` policy at cap K (time_policy on) at batch n: its clock splits each
  step into the draft side (propose) and the rest, the target pass over
  (N_T + N_D) / steps tokens plus sampling and bookkeeping.
Writes costs.json (the file `adaptive_spec.costs` reads: draft_step_ms per request count,
verify_ms per token count; medians of repeats) and raw.json beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.paths import REPO, load_prompts

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function
BATCHES = (1, 2, 4, 8, 16, 32)
MAX_TOKENS = 96


def _generate(llm, prompts: list[str]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _plugin_totals(llm) -> dict:
    from vllm_adaptive_spec.integration.runtime import get_stats

    (snap,) = get_stats(llm)
    return {**snap["workload"], **snap["timing"]}


def _plugin_rows(llm, prompts: list[str], k: int, repeats: int) -> list[dict]:
    """`repeats` runs of `prompts` on a plugin engine with the fixed policy at cap k: per-step splits."""
    rows = []
    for _ in range(repeats):
        before = _plugin_totals(llm)
        wall = _generate(llm, prompts)
        after = _plugin_totals(llm)
        d = {key: after[key] - before[key] for key in ("rounds", "propose_s", "n_target", "n_draft")}
        steps = max(d["rounds"], 1)
        rows.append(
            {
                "draft_step_ms": 1e3 * d["propose_s"] / steps / k,
                "rest_ms": 1e3 * (wall - d["propose_s"]) / steps,
                "tokens_per_step": (d["n_target"] + d["n_draft"]) / steps,
            }
        )
    return rows


def measure(k: int, repeats: int, method: str = "draft_model", batch1_ks: tuple[int, ...] = ()) -> dict:
    """No speculation at every batch size, the fixed policy at cap k at every batch size, and at batch 1
    the fixed policy at each cap in `batch1_ks` (more points on the batch-1 verify curve, whose shape
    decides how long a draft pays where a pass over 1 + K tokens costs more than one over 1 token)."""
    from benchmarks import vllm_run

    prompts = load_prompts("code_heldout", max(BATCHES))
    raw: dict = {"nospec": {}, "plugin": {}, "batch1": {}, "k": k, "max_tokens": MAX_TOKENS, "method": method}
    raw["target"] = str(vllm_run.TARGET)
    llm = vllm_run.make_llm()
    try:
        _generate(llm, prompts[:2])  # warm-up
        for n in BATCHES:
            raw["nospec"][n] = [1e3 * _generate(llm, prompts[:n]) / MAX_TOKENS for _ in range(repeats)]
    finally:
        vllm_run.close_llm(llm)
    for cap in (k, *batch1_ks):
        llm = vllm_run.make_llm(cap, {"policy": "fixed", "time_policy": True}, method=method)
        try:
            _generate(llm, prompts[:2])
            if cap == k:
                for n in BATCHES:
                    raw["plugin"][n] = _plugin_rows(llm, prompts[:n], k, repeats)
            else:
                raw["batch1"][cap] = _plugin_rows(llm, prompts[:1], cap, repeats)
        finally:
            vllm_run.close_llm(llm)
    return raw


def curves(raw: dict) -> dict:
    med = statistics.median
    verify = [[n, round(med(ms), 4)] for n, ms in raw["nospec"].items()]
    verify += [
        [round(med(r["tokens_per_step"] for r in rows), 1), round(med(r["rest_ms"] for r in rows), 4)]
        for rows in [*raw["plugin"].values(), *raw.get("batch1", {}).values()]
    ]
    draft = [[n, round(med(r["draft_step_ms"] for r in rows), 4)] for n, rows in raw["plugin"].items()]
    return {"draft_step_ms": sorted(draft), "verify_ms": sorted(verify)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_costs")
    ap.add_argument("--k", type=int, default=8, help="the fixed cap the draft side is timed at")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--batch1-ks", default="", help="more caps timed at batch 1 only, e.g. 2,4,16: batch-1 verify-curve points"
    )
    ap.add_argument("--method", choices=("draft_model", "eagle3"), default="draft_model", help="the bundled drafter")
    ap.add_argument("--target-mlp-factor", type=int, default=1, help="measure on a cost-scaled copy of the target")
    ap.add_argument("--draft-mlp-factor", type=int, default=1, help="... and of the draft model")
    args = ap.parse_args()
    from benchmarks.scaled_models import use_scaled_copies

    use_scaled_copies(args.target_mlp_factor, args.draft_mlp_factor)  # a regime's gate and vllm_av read its costs
    batch1_ks = tuple(int(x) for x in args.batch1_ks.split(",") if x)
    raw = measure(args.k, args.repeats, args.method, batch1_ks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "raw.json").write_text(json.dumps(raw, indent=1) + "\n")
    costs = curves(raw)
    (args.out / "costs.json").write_text(json.dumps(costs, indent=1) + "\n")
    print(json.dumps(costs, indent=1))


if __name__ == "__main__":
    main()
