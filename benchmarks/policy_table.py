"""Every stopping policy against fixed K on held-out prompts, through vLLM.

    .venv/bin/python -m benchmarks.policy_table            # ~10 min on 2 cores

For each configuration (its own engine): greedy generation at batch 1 with
cap K, the plugin's statistics (N_gen, N_T, N_D, N_acc), wall-clock tokens/s
(median of repeats), and modeled speedup at the measured cost ratio c (from
benchmarks/models/measurements.json) and at c = 4. The policy's own cost per
draft step is timed separately on a [1, V] distribution and reported as a
fraction of one draft step t_D. Writes benchmarks/results/policy_table.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks import vllm_run
from benchmarks.paths import MODELS, REPO, load_prompts
from vllm_adaptive_spec.config import AdaptiveSpecConfig
from vllm_adaptive_spec.metrics import modeled_speedup

log = logging.getLogger("policy_table")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function

CONFIGS = [  # (label, cap K, adaptive_spec): defaults first, then threshold sweeps
    ("fixed K=16", 16, {"policy": "fixed"}),
    ("svip h=0.3 (default)", 16, {"policy": "svip"}),
    ("svip h=0.5", 16, {"policy": "svip", "threshold": 0.5}),
    ("svip h=0.7", 16, {"policy": "svip", "threshold": 0.7}),
    ("svip h=0.8", 16, {"policy": "svip", "threshold": 0.8}),
    ("svip h=0.9", 16, {"policy": "svip", "threshold": 0.9}),
    ("adaedl (default)", 16, {"policy": "adaedl"}),
    ("adaedl a=0.5", 16, {"policy": "adaedl", "target_ar": 0.5}),
    ("adaedl lam=0.2 a=0.5", 16, {"policy": "adaedl", "lam": 0.2, "target_ar": 0.5}),
    ("adaedl lam=0.2 a=0.3", 16, {"policy": "adaedl", "lam": 0.2, "target_ar": 0.3}),
    ("adaedl lam=0 a=0.1", 16, {"policy": "adaedl", "lam": 0.0, "target_ar": 0.1}),
    ("confidence 0.4 (default)", 16, {"policy": "confidence"}),
    ("confidence 0.2", 16, {"policy": "confidence", "threshold": 0.2}),
    ("heuristic (default)", 16, {"policy": "heuristic"}),
]


def policy_cost_s(adaptive: dict, vocab: int, iters: int = 2000) -> float:
    """Seconds per draft step spent in the policy (probabilities + decision), batch 1."""
    from vllm_adaptive_spec.integration.proposer import policy_logprobs

    policy = AdaptiveSpecConfig.from_dict(adaptive).build_policy()
    policy.round_limits(["r"], 16)
    logits = torch.randn(1, vocab)
    tokens = logits.argmax(-1)
    for _ in range(50):
        policy.decide(policy_logprobs(logits, None), tokens, 0)
    start = time.perf_counter()
    for _ in range(iters):
        policy.decide(policy_logprobs(logits, None), tokens, 0)
    return (time.perf_counter() - start) / iters


def run(label: str, k: int, adaptive: dict, prompts: list[str], args) -> dict:
    from vllm_adaptive_spec.integration.runtime import get_stats

    llm = vllm_run.make_llm(k=k, adaptive=adaptive)
    (before,) = get_stats(llm)
    rates = vllm_run.repeated_rates(llm, prompts, args.max_tokens, 1, args.repeats)
    (after,) = get_stats(llm)
    vllm_run.close_llm(llm)
    w0, w1 = before["workload"], after["workload"]
    counts = {key: w1[key] - w0[key] for key in ("n_gen", "n_target", "n_draft", "n_accepted")}
    return {"label": label, "k": k, "adaptive": adaptive, "tokens_per_s": statistics.median(rates),
            "tokens_per_s_all": rates, **counts}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--only", nargs="*", help="run only configurations whose label contains one of these")
    ap.add_argument("--extra", type=json.loads, default=[], help='more configs: [["label", K, {...}], ...]')
    ap.add_argument("--name", default="policy_table", help="output file stem")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    measured = json.loads((MODELS / "measurements.json").read_text())["timing"]
    c, t_draft = measured["c"], measured["t_draft_step_s"]
    vocab = json.loads((MODELS / "toy-target" / "config.json").read_text())["vocab_size"]
    prompts = load_prompts("code_heldout", args.n_prompts)
    base = vllm_run.make_llm()
    base_tps = statistics.median(vllm_run.repeated_rates(base, prompts, args.max_tokens, 1, args.repeats))
    vllm_run.close_llm(base)

    # the first row is the reference of the relative columns: keep fixed K=16 first
    configs = [c for c in CONFIGS if not args.only or any(o in c[0] for o in args.only)]
    configs += [tuple(c) for c in args.extra]
    rows = []
    for label, k, adaptive in configs:
        row = run(label, k, adaptive, prompts, args)
        cost = policy_cost_s(adaptive, vocab) if adaptive["policy"] != "fixed" else 0.0
        # o: the policy's time per generated token, in units of one target step
        overhead = cost * row["n_draft"] / row["n_gen"] / (c * t_draft)
        row.update(
            tau=row["n_gen"] / row["n_target"],
            draft_per_token=row["n_draft"] / row["n_gen"],
            discard_rate=(row["n_draft"] - row["n_accepted"]) / row["n_gen"],
            policy_cost_frac_of_draft_step=cost / t_draft,
            speedup_measured_c=modeled_speedup(row["n_gen"], row["n_target"], row["n_draft"], c, overhead),
            speedup_c4=modeled_speedup(row["n_gen"], row["n_target"], row["n_draft"], 4.0, overhead * c / 4.0),
            wall_vs_no_spec=row["tokens_per_s"] / base_tps,
        )
        rows.append(row)
        log.info("%s", row)

    ref = rows[0]
    lines = [
        "# Stopping policies against fixed K (batch 1, greedy)",
        "",
        f"{len(prompts)} held-out code prompts, max_tokens={args.max_tokens}, cap K=16, median of "
        f"{args.repeats}; c = {c:.2f} measured (benchmarks/models/measurements.json); no speculation "
        f"{base_tps:.1f} tokens/s. Written by `python -m benchmarks.policy_table`.",
        "",
        "| config | tau | draft tok / gen tok | vs fixed K=16 | discard rate | policy cost / draft step "
        f"| S (c={c:.2f}) | S (c=4) | tokens/s | wall vs no spec |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['tau']:.2f} ({r['tau'] / ref['tau'] - 1:+.0%}) | {r['draft_per_token']:.2f} "
            f"| {r['draft_per_token'] / ref['draft_per_token'] - 1:+.0%} | {r['discard_rate']:.2f} "
            f"| {r['policy_cost_frac_of_draft_step']:.2%} | {r['speedup_measured_c']:.3f} | {r['speedup_c4']:.3f} "
            f"| {r['tokens_per_s']:.1f} | {r['wall_vs_no_spec']:.2f}x |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"c": c, "no_spec_tokens_per_s": base_tps,
                                                            "rows": rows}, indent=2) + "\n")  # fmt: skip
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
