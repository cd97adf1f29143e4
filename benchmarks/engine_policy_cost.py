"""Each policy's own cost inside vLLM's draft loop (`adaptive_spec.time_policy`).

    .venv/bin/python -m benchmarks.engine_policy_cost [--configs "svip h=0.7;pacer (layer defaults)"] [--batches 1,16]

Configurations are the harness's (benchmarks/harness/plan.py), by name. For
every configuration and batch size: one engine (toy pair, cap K = 16), a
warm-up, then the held-out code prompts (16 at batch 1, 32 otherwise,
64 tokens, greedy) sent `batch` at a time, `--repeats` times with the
statistics reset in between. Reports, per pass, the time in the policy's
calls against everything else the draft side does (policy share, see
vllm_adaptive_spec/policies/timing.py), the policy's microseconds per
decide call (one draft step of the batch), and tokens/s. Prints a table
and writes JSON + Markdown under benchmarks/results/engine_policy_cost/;
the harness report (`--report-only`) reads the JSON and charges these
in-engine costs in its modeled speedups.
On a shared machine the figures are noisy: the medians of repeats are
reported with their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats: collective_rpc with a function

from benchmarks import vllm_run  # noqa: E402  (sets vLLM's environment first)
from benchmarks.paths import REPO, load_prompts  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "engine_policy_cost"
DEFAULT_CONFIGS = (
    "plugin fixed K=16",
    "svip h=0.7",
    "confidence 0.4 (default)",
    "specdecpp th=0.65",
    "specdecpp th=0.8 (head default)",
    "pacer (layer defaults)",
)


def _adaptive(name: str) -> dict:
    """The harness configuration's adaptive_spec dict, with time_policy on."""
    from benchmarks.harness.plan import full_plan

    found = [c for c in full_plan().configs if c.name == name and c.kind == "plugin"]
    if not found:
        raise SystemExit(f"no plugin configuration named {name!r} in benchmarks/harness/plan.py")
    return {**found[0].adaptive, "time_policy": True}


def _timing(llm) -> dict:
    from vllm_adaptive_spec.integration.runtime import get_stats

    return get_stats(llm)[0]["timing"]


def measure(spec: str, batches: list[int], repeats: int, tokens: int) -> list[dict]:
    from vllm import SamplingParams

    llm = vllm_run.make_llm(k=16, adaptive=_adaptive(spec))
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    rows = []
    try:
        for batch in batches:
            prompts = load_prompts("code_heldout", 16 if batch == 1 else 32)
            llm.generate(prompts[:batch], params, use_tqdm=False)  # warm-up
            passes = []
            for _ in range(repeats):
                before = _timing(llm)
                start, n_tok = time.perf_counter(), 0
                for i in range(0, len(prompts), batch):
                    outs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
                    n_tok += sum(len(o.outputs[0].token_ids) for o in outs)
                seconds = time.perf_counter() - start
                after = _timing(llm)
                policy = after["policy_s"] - before["policy_s"]
                propose = after["propose_s"] - before["propose_s"]
                decides = after["decides"] - before["decides"]
                passes.append(
                    {
                        "policy_share": policy / (propose - policy),
                        "policy_us_per_decide": 1e6 * policy / max(decides, 1),
                        "draft_side_share_of_wall": propose / seconds,
                        "tokens_per_s": n_tok / seconds,
                        "policy_ms_per_token": 1e3 * policy / n_tok,
                    }
                )
            row = {"config": spec, "batch": batch, "repeats": repeats}
            for key in passes[0]:
                values = [p[key] for p in passes]
                row[key] = statistics.median(values)
                row[key + "_range"] = [min(values), max(values)]
            rows.append(row)
            print(_line(row), flush=True)
    finally:
        vllm_run.close_llm(llm)
    return rows


def _line(r: dict) -> str:
    return (
        f"| {r['config']} | {r['batch']} | {100 * r['policy_share']:.1f}% "
        f"[{100 * r['policy_share_range'][0]:.1f}, {100 * r['policy_share_range'][1]:.1f}] "
        f"| {r['policy_us_per_decide']:.0f} | {100 * r['draft_side_share_of_wall']:.0f}% "
        f"| {r['tokens_per_s']:.0f} |"
    )


HEADER = (
    "| config | batch | policy time / rest of draft side | policy us per draft step | draft side / wall | tok/s |\n"
    "|---|---|---|---|---|---|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=";".join(DEFAULT_CONFIGS), help="harness configuration names, ';'-separated")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--name", default="report", help="output file stem")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(HEADER)
    rows = []
    for name in args.configs.split(";"):
        rows += measure(name.strip(), batches, args.repeats, args.tokens)
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {"rows": rows, "command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M")}
    (OUT / f"{args.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (OUT / f"{args.name}.md").write_text(HEADER + "\n" + "\n".join(_line(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
