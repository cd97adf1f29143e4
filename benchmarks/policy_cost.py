"""The policies' own cost inside vLLM at batch 1, without the batch gate.

    .venv/bin/python -m benchmarks.policy_cost [--drafter eagle3] [--n-prompts 8] [--max-tokens 64]
        [--repeats 3] [--specdecpp-head NAME=PATH ...]

One engine per policy (the bundled drafter, cap K=16, `time_policy` on, gate off,
max_num_seqs=1 so every draft step has one row), held-out code prompts, greedy.
Prints and saves f = the policy's time over the rest of the draft side's time
(what the harness charges) and microseconds per draft step. A ratio inside one
process: drift of a shared machine moves both sides, but it stays noisy. With
--repeats N every policy runs N times, the order reversed every other repeat
(interleaved), and each row keeps its runs and their medians; --specdecpp-head
adds a SpecDec++ row per head file (e.g. an ablation beside the bundled head).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks import vllm_run
from benchmarks.harness.plan import EAGLE3_PACER_HEAD, EAGLE3_SPECDECPP_HEAD, PACER_HEAD, SPECDECPP_HEAD
from benchmarks.paths import REPO, load_prompts

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function


def policies(drafter: str, specdecpp_heads: dict[str, str] | None = None) -> dict[str, dict]:
    specdecpp, pacer = (
        (EAGLE3_SPECDECPP_HEAD, EAGLE3_PACER_HEAD) if drafter == "eagle3" else (SPECDECPP_HEAD, PACER_HEAD)
    )
    return {
        "fixed": {"policy": "fixed"},
        "svip": {"policy": "svip"},
        "confidence": {"policy": "confidence"},
        "specdecpp": {"policy": "specdecpp", "head": str(specdecpp)},
        "pacer": {"policy": "pacer", "head": str(pacer)},
    } | {name: {"policy": "specdecpp", "head": path} for name, path in (specdecpp_heads or {}).items()}


def summary(runs: list[dict]) -> dict:
    """One row's runs -> their medians (and the runs themselves when there are several)."""
    if len(runs) == 1:
        return runs[0]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"runs": runs}


def measure(drafter: str, adaptive: dict, prompts: list[str], max_tokens: int) -> dict:
    from vllm_adaptive_spec.integration.runtime import get_stats

    adaptive = adaptive | {"batch_aware": False, "time_policy": True}
    llm = vllm_run.make_llm(16, adaptive, method=drafter, max_num_seqs=1)
    try:
        llm.generate(prompts[:1], vllm_run.greedy_params(max_tokens), use_tqdm=False)  # warm-up
        before = [s.get("timing", {}) for s in get_stats(llm)][0]
        llm.generate(prompts, vllm_run.greedy_params(max_tokens), use_tqdm=False)
        after = [s.get("timing", {}) for s in get_stats(llm)][0]
    finally:
        vllm_run.close_llm(llm)
    d = {k: after[k] - before.get(k, 0) for k in ("policy_s", "propose_s", "decides")}
    draft_s = d["propose_s"] - d["policy_s"]
    return {
        "policy_share": round(d["policy_s"] / draft_s, 4),
        "policy_us_per_step": round(1e6 * d["policy_s"] / d["decides"], 1),
        "draft_us_per_step": round(1e6 * draft_s / d["decides"], 1),
        "draft_steps": d["decides"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="eagle3", choices=("draft_model", "eagle3"))
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="these policies only")
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy, interleaved (medians saved)")
    ap.add_argument(
        "--specdecpp-head", action="append", default=[], metavar="NAME=PATH", help="another SpecDec++ head's row"
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "policy_cost_b1"))
    args = ap.parse_args()
    heads = dict(arg.split("=", 1) for arg in args.specdecpp_head)
    prompts = load_prompts("code_heldout", args.n_prompts)
    plan = {n: a for n, a in policies(args.drafter, heads).items() if not args.only or n in args.only}
    runs: dict[str, list[dict]] = {name: [] for name in plan}
    for repeat in range(args.repeats):
        for name in list(plan) if repeat % 2 == 0 else list(plan)[::-1]:
            runs[name].append(measure(args.drafter, plan[name], prompts, args.max_tokens))
            print(repeat, name, runs[name][-1], flush=True)
    rows = {name: summary(r) for name, r in runs.items()}
    os.makedirs(args.out, exist_ok=True)
    out = f"{args.out}/{args.drafter}.json"
    with open(out, "w") as fh:
        json.dump({"drafter": args.drafter, "batch": 1, "gate": False, **vars(args), "rows": rows}, fh, indent=1)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
