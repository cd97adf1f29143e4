"""The main job on the bundled toy pair: generate through vLLM with and without
speculation and print tokens/s and acceptance.

    bash scripts/demo.sh                 # set-up + this script (a few minutes)
    .venv/bin/python -m benchmarks.run_toy --k 8 --batch 4

Configurations, each on its own engine, on the same held-out code prompts:
no speculation; vLLM's draft-model speculation with fixed K; the plugin
(`adaptive_spec`) with policy `fixed` and with policy `svip` (cap K). Greedy
outputs are checked against the no-speculation output. Figures are medians over repeats; the machine is
shared, so small differences are noise.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
from pathlib import Path

from benchmarks import vllm_run
from benchmarks.paths import REPO, load_prompts

log = logging.getLogger("run_toy")


def run_config(name: str, prompts: list[str], args, **engine) -> dict:
    llm = vllm_run.make_llm(**engine)
    outputs = vllm_run.generate_tokens(llm, prompts, args.max_tokens)  # also warms up
    before = vllm_run.spec_metrics(llm)
    rates = vllm_run.repeated_rates(llm, prompts, args.max_tokens, args.batch, args.repeats)
    spec = vllm_run.spec_metrics(llm) - before
    vllm_run.close_llm(llm)
    row = {
        "name": name,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_all": rates,
        "outputs": outputs,
    }
    if spec.drafts:
        row.update(
            mean_acceptance_length=spec.mean_acceptance_length,
            draft_acceptance_rate=spec.accepted / spec.draft_tokens,
            accepted_per_pos=list(spec.accepted_per_pos),
        )
    log.info("%s: %.1f tokens/s", name, row["tokens_per_s"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (the cap K)")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="prompts sent together")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "toy_demo.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    prompts = load_prompts("code_heldout", args.n_prompts)
    rows = [
        run_config("no speculation", prompts, args),
        run_config(f"vLLM draft_model K={args.k}", prompts, args, k=args.k),
        run_config(f"plugin fixed K={args.k}", prompts, args, k=args.k, adaptive={"policy": "fixed"}),
        run_config(f"plugin svip cap K={args.k}", prompts, args, k=args.k, adaptive={"policy": "svip"}),
    ]
    reference = rows[0]["outputs"]
    base = rows[0]["tokens_per_s"]
    print(
        f"\n{len(prompts)} held-out code prompts, greedy, max_tokens={args.max_tokens}, batch {args.batch}, "
        f"median of {args.repeats}"
    )
    print(
        f"{'configuration':<30} {'tokens/s':>9} {'vs no spec':>10} {'accept len':>10} {'draft acc':>9} "
        f"{'same output':>11}"
    )
    for row in rows:
        row["same_as_reference"] = row["outputs"] == reference
        tau = row.get("mean_acceptance_length")
        acc = row.get("draft_acceptance_rate")
        print(
            f"{row['name']:<30} {row['tokens_per_s']:>9.1f} {row['tokens_per_s'] / base:>9.2f}x "
            f"{'-' if tau is None else f'{tau:.2f}':>10} {'-' if acc is None else f'{acc:.0%}':>9} "
            f"{str(row['same_as_reference']):>11}"
        )
        del row["outputs"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
    }
    args.out.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "env": env, "rows": rows}, indent=2) + "\n"
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
