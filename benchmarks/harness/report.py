"""Turns the workers' JSON into metrics, a Markdown report and PNG plots.

Metrics follow ALGORITHMS.md. The cost ratio c = t_T / t_D is measured per
workload and batch size from the same timed cells: t_T is a no-speculation
engine step (seconds per pass / engine steps), t_D the slope of a vLLM
fixed-K engine step over K (least squares over every K run). Modeled
speedups S(c) charge the policy's own time: f, its time per draft step as a
share of a batch-1 draft step t_D (from a batch-1 microbenchmark, or from
the engine itself with benchmarks/engine_policy_cost.py), is added to every
drafted token, i.e. o = f (N_D/N_gen) / c target steps per generated token.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from vllm_adaptive_spec.metrics import modeled_speedup

C_PAPER = 4.0  # the papers' 1.3B/33B pair
ENGINE_COST_JSON = Path(__file__).resolve().parents[1] / "results" / "engine_policy_cost" / "report.json"


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Counts -> tau, discard and verification rates, draft tokens per generated token."""
    n_gen, n_acc, n_d = row["n_gen"], row["n_accepted"], row["n_draft"]
    n_t = row.get("n_target", n_gen - n_acc)
    return row | {
        "n_target": n_t,
        "tau": n_gen / n_t if n_t else float("nan"),
        "discard_rate": (n_d - n_acc) / n_gen if n_gen else float("nan"),
        "verification_rate": n_t / n_gen if n_gen else float("nan"),
        "draft_per_token": n_d / n_gen if n_gen else float("nan"),
    }


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cost_ratios(results: list[dict]) -> dict[str, dict]:
    """Per timed greedy cell key: t_T, t_D, c (see module docstring)."""
    per_key: dict[str, dict] = {}
    for res in results:
        cfg = res["config"]
        for row in res.get("cells", []):
            cell = row["cell"]
            if not cell["timed"] or cell["temperature"] != 0.0 or not row.get("steps"):
                continue
            step_s = _median(row["seconds"]) / row["steps"]
            entry = per_key.setdefault(cell["key"], {"ks": [], "step_s": []})
            if cfg["kind"] == "nospec":
                entry["t_target_s"] = step_s
            elif cfg["kind"] == "vllm" and cfg["dynamic"] is None:
                entry["ks"].append(cfg["k"])
                entry["step_s"].append(step_s)
    out = {}
    for key, e in per_key.items():
        if "t_target_s" not in e or len(e["ks"]) < 2:
            continue
        ks = np.array(e["ks"], dtype=float)
        (fixed, slope), *_ = np.linalg.lstsq(np.stack([np.ones_like(ks), ks], 1), np.array(e["step_s"]), rcond=None)
        out[key] = {
            "t_target_s": e["t_target_s"],
            "t_draft_s": float(slope),
            "t_spec_fixed_s": float(fixed),
            "c": e["t_target_s"] / slope if slope > 0 else float("nan"),
        }
    return out


def _c_for(cell: dict, ratios: dict[str, dict]) -> dict | None:
    """The cost ratio measured on this cell, or on the timed greedy cell closest in batch size."""
    key = f"timed/{cell['workload']}/b{cell['batch']}/t0"
    if key in ratios:
        return ratios[key]
    same = [(abs(int(k.split("/b")[1].split("/")[0]) - cell["batch"]), k) for k in ratios if cell["workload"] in k]
    return ratios[min(same)[1]] if same else None


def _charged_speedup(row: dict, c: float, f: float) -> float:
    """S(c) charging the policy f draft steps' worth of time per drafted token: o = f (N_D/N_gen) / c,
    in target steps (a draft step is 1/c of one)."""
    o = f * row["n_draft"] / row["n_gen"] / c if row["n_gen"] else 0.0
    return modeled_speedup(row["n_gen"], row["n_target"], row["n_draft"], c, o)


def tabulate(results: list[dict]) -> dict[str, Any]:
    """Every (configuration, cell) with its metrics; the oracle and best fixed K per count cell."""
    ratios = cost_ratios(results)
    base = {}  # cell key -> no-speculation row
    for res in results:
        if res["config"]["kind"] == "nospec":
            base = {row["cell"]["key"]: row for row in res["cells"]}
    # The microbenchmark times a policy at batch 1: f = its cost as a share of a batch-1 draft step.
    t_draft_b1 = _median([r["t_draft_s"] for k, r in ratios.items() if "/b1/" in k])
    rows = []
    for res in results:
        cfg = res["config"]
        for row in res.get("cells", []):
            row = derive(row)
            cell = row["cell"]
            ref = base.get(cell["key"])
            c = _c_for(cell, ratios)
            cost = res.get("policy_cost_s", 0.0)
            f = cost / t_draft_b1 if cost and t_draft_b1 == t_draft_b1 else 0.0
            tps = _median(row["tokens_per_s"])
            rows.append(
                row
                | {
                    "config": cfg["name"],
                    "family": cfg["family"],
                    "kind": cfg["kind"],
                    "sweep": cfg["sweep"],
                    "tokens_per_s_median": tps,
                    "tokens_per_s_spread": [min(row["tokens_per_s"]), max(row["tokens_per_s"])],
                    "speedup_vs_no_spec": tps / _median(ref["tokens_per_s"]) if ref else None,
                    "lossless": (
                        sum(a == b for a, b in zip(row["output_hashes"], ref["output_hashes"]))
                        / len(ref["output_hashes"])
                    )
                    if ref and cell["temperature"] == 0.0 and len(ref["output_hashes"]) == len(row["output_hashes"])
                    else None,
                    "c": c["c"] if c else None,
                    "policy_cost_frac_of_draft_step": f,
                    "S_measured_c": _charged_speedup(row, c["c"], f) if c else None,
                    "S_c4": _charged_speedup(row, C_PAPER, f),
                }
            )
    oracle = []
    for res in results:
        for r in res.get("replay", []):
            r = derive(r)
            c = _c_for(r["cell"], ratios)
            oracle.append(
                r
                | {
                    "S_measured_c": modeled_speedup(r["n_gen"], r["n_target"], r["n_draft"], c["c"]) if c else None,
                    "S_c4": modeled_speedup(r["n_gen"], r["n_target"], r["n_draft"], C_PAPER),
                }
            )
    return {"cost_ratios": ratios, "rows": rows, "replay": oracle}


def best_by(rows: list[dict], metric: str) -> dict | None:
    good = [r for r in rows if r.get(metric) is not None]
    return max(good, key=lambda r: r[metric]) if good else None


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x != x:
        return "nan"
    return format(x, spec)


def markdown(table: dict[str, Any], env: dict[str, Any], title: str) -> str:
    rows, replay = table["rows"], table["replay"]
    lines = [f"# {title}", "", f"Environment: {env.get('summary', '')}", ""]
    lines += [
        "Metric definitions: ALGORITHMS.md. tau = N_gen/N_T with N_T = N_gen - N_acc (vLLM's counters); "
        "S = modeled speedup over no speculation, at the cost ratio c measured on the same cell and at "
        "c = 4, charging the policy's own time per drafted token ('policy cost / draft step': a batch-1 "
        "microbenchmark as a share of a batch-1 draft step; the in-engine section below is the better figure); "
        "'lossless' = share of prompts whose greedy output equals no speculation's on the same cell. "
        "Wall-clock figures come from a shared 2-core machine: medians of repeats, spread in brackets.",
        "",
    ]
    lines += [
        "## Measured cost ratio c = t_T / t_D",
        "",
        "| cell | t_T (ms) | t_D (ms) | fixed spec-step cost (ms) | c |",
        "|---|---|---|---|---|",
    ]
    for key, r in sorted(table["cost_ratios"].items()):
        lines.append(
            f"| {key} | {r['t_target_s'] * 1e3:.2f} | {r['t_draft_s'] * 1e3:.2f} | "
            f"{r['t_spec_fixed_s'] * 1e3:.2f} | {r['c']:.2f} |"
        )
    count_keys = sorted({r["cell"]["key"] for r in rows if not r["cell"]["timed"]})
    for key in count_keys:
        here = [r for r in rows if r["cell"]["key"] == key]
        cell = here[0]["cell"]
        fixed = [r for r in here if r["family"] == "fixed K"]
        lines += [
            "",
            f"## Counts: {cell['workload']}, {cell['n_prompts']} prompts x {cell['max_tokens']} tokens, "
            f"greedy, batch {cell['batch']}",
            "",
        ]
        for metric, label in (("S_measured_c", "measured c"), ("S_c4", "c = 4")):
            best = best_by(fixed, metric)
            orc = best_by([o for o in replay if o["cell"]["key"] == key and o["oracle"]], metric)
            if best and orc:
                lines.append(
                    f"- best fixed K at {label}: {best['config']} (S {best[metric]:.3f}); oracle "
                    f"{orc[metric]:.3f} at cap K={orc['k']} ({orc[metric] / best[metric]:.2f}x best fixed K)"
                )
        lines += [
            "",
            "| config | tau | discard rate | verification rate | draft tok / gen tok | policy cost / draft step "
            "| S (measured c) | S (c=4) | S(c=4) vs best fixed K | lossless |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        best4 = best_by(fixed, "S_c4")
        for r in here:
            rel = r["S_c4"] / best4["S_c4"] if best4 else None
            lines.append(
                f"| {r['config']} | {_fmt(r['tau'])} | {_fmt(r['discard_rate'])} | {_fmt(r['verification_rate'])} "
                f"| {_fmt(r['draft_per_token'])} | {_fmt(r['policy_cost_frac_of_draft_step'], '.1%')} "
                f"| {_fmt(r['S_measured_c'], '.3f')} | {_fmt(r['S_c4'], '.3f')} | {_fmt(rel, '.3f')}x "
                f"| {_fmt(r['lossless'], '.0%')} |"
            )
        orc = [o for o in replay if o["cell"]["key"] == key and o["oracle"]]
        if orc:
            lines += [
                "",
                "Oracle (teacher-forced replay) per cap K: "
                + ", ".join(f"K={o['k']}: tau {o['tau']:.2f}, S(c=4) {o['S_c4']:.3f}" for o in orc),
            ]
    lines += engine_cost_section(table)
    lines += pacer_ablation_section(table)
    timed_keys = sorted({r["cell"]["key"] for r in rows if r["cell"]["timed"]})
    lines += [
        "",
        "## Wall clock",
        "",
        "tokens/s, median of repeats [min, max], and the ratio to no speculation "
        "on the same cell (below 1.00x: speculation loses).",
        "",
    ]
    configs = list(dict.fromkeys(r["config"] for r in rows if r["cell"]["timed"]))
    lines.append("| config | " + " | ".join(k.removeprefix("timed/") for k in timed_keys) + " |")
    lines.append("|---|" + "---|" * len(timed_keys))
    for name in configs:
        cells = []
        for key in timed_keys:
            r = next((r for r in rows if r["config"] == name and r["cell"]["key"] == key), None)
            if r is None:
                cells.append("-")
                continue
            lo, hi = r["tokens_per_s_spread"]
            ratio = f" {r['speedup_vs_no_spec']:.2f}x" if r["speedup_vs_no_spec"] is not None else ""
            loss = "" if r["lossless"] in (None, 1.0) else f" (lossless {r['lossless']:.0%})"
            cells.append(f"{r['tokens_per_s_median']:.0f} [{lo:.0f}, {hi:.0f}]{ratio}{loss}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for key in timed_keys:
        best = best_by([r for r in rows if r["cell"]["key"] == key and r["family"] == "fixed K"], "tokens_per_s_median")
        top = best_by([r for r in rows if r["cell"]["key"] == key], "tokens_per_s_median")
        if best and top:
            lines.append(
                f"- {key.removeprefix('timed/')}: best fixed K {best['config']} "
                f"({best['speedup_vs_no_spec']:.2f}x); fastest {top['config']} ({top['speedup_vs_no_spec']:.2f}x)"
            )
    return "\n".join(lines) + "\n"


def engine_costs(
    table: dict[str, Any], path: Path = ENGINE_COST_JSON, count_key: str = "count/code_heldout/b32/t0"
) -> list[dict]:
    """In-engine policy costs (benchmarks/engine_policy_cost.py, batch 1, code prompts) charged
    to the code count cell's counts: f = policy time per draft step / t_D (timed code b1 cell)."""
    t_d = table["cost_ratios"].get("timed/code_heldout/b1/t0", {}).get("t_draft_s")
    if not path.exists() or not t_d:
        return []
    counts = {r["config"]: r for r in table["rows"] if r["cell"]["key"] == count_key}
    out = []
    for e in json.loads(path.read_text())["rows"]:
        r = counts.get(e["config"])
        if e["batch"] != 1 or r is None:
            continue
        f = e["policy_us_per_decide"] * 1e-6 / t_d
        out.append(
            {
                "config": e["config"],
                "count_key": count_key,
                "engine": e,
                "f": f,
                "S_c4_no_cost": modeled_speedup(r["n_gen"], r["n_target"], r["n_draft"], C_PAPER),
                "S_c4_engine_cost": _charged_speedup(r, C_PAPER, f),
            }
        )
    return out


def engine_cost_section(table: dict[str, Any]) -> list[str]:
    rows = table.get("engine_costs") or []
    if not rows:
        return []
    best = best_by(
        [r for r in table["rows"] if r["cell"]["key"] == "count/code_heldout/b32/t0" and r["family"] == "fixed K"],
        "S_c4",
    )
    lines = [
        "",
        "## Policy cost inside the engine (code prompts, batch 1)",
        "",
        "Measured with `adaptive_spec.time_policy` in vLLM's draft loop (`python -m benchmarks.engine_policy_cost`), "
        "not on synthetic tensors: the microbenchmark column above "
        "times the policy alone, on a hot cache, and reads 1.5-2.5x fewer microseconds. "
        "share = policy time / the rest of the draft side's time; f = policy time per draft step / t_D of the timed "
        "code b1 cell; S(c=4) charges f per drafted token on the code count cell's counts. "
        "Noisy: shared 2-core machine.",
        "",
        "| config | share [min, max] | us / draft step | f | S(c=4) no cost | S(c=4) with in-engine cost "
        "| vs best fixed K |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r["engine"]
        lo, hi = e["policy_share_range"]
        rel = r["S_c4_engine_cost"] / best["S_c4"] if best else None
        lines.append(
            f"| {r['config']} | {e['policy_share']:.1%} [{lo:.1%}, {hi:.1%}] | {e['policy_us_per_decide']:.0f} "
            f"| {r['f']:.1%} | {r['S_c4_no_cost']:.3f} | {r['S_c4_engine_cost']:.3f} | {_fmt(rel, '.3f')}x |"
        )
    return lines


def pacer_ablation_section(table: dict[str, Any], key: str = "count/code_heldout/b32/t0") -> list[str]:
    """Pacer's ablations (paper tables 5, 7, 8, 11) on counts alone: S(c=4) without the policy's cost."""
    here = [r for r in table["rows"] if r["cell"]["key"] == key]
    abl = [r for r in here if r["family"] == "pacer ablation"]
    base = next((r for r in here if r["config"] == "pacer (layer defaults)"), None)
    if not abl or base is None:
        return []
    lines = [
        "",
        "## Pacer ablations through vLLM (code prompts, counts only)",
        "",
        "Each row changes one setting of the bundled layer's recommended ones (block 2, threshold 0.7, "
        "growth 1.0, mean halting, context window 64); S(c=4) here charges no policy cost, so the rows "
        "compare stopping decisions only. The position pair is two layers trained alike on 500 responses "
        "(block 2, threshold 0.5, growth 1.0).",
        "",
        "| config | tau | draft tok / gen tok | S(c=4), no cost | vs layer defaults |",
        "|---|---|---|---|---|",
    ]
    s0 = modeled_speedup(base["n_gen"], base["n_target"], base["n_draft"], C_PAPER)
    for r in [base, *abl]:
        s4 = modeled_speedup(r["n_gen"], r["n_target"], r["n_draft"], C_PAPER)
        lines.append(f"| {r['config']} | {r['tau']:.3f} | {r['draft_per_token']:.3f} | {s4:.3f} | {s4 / s0:.3f}x |")
    return lines


def headline(table: dict[str, Any]) -> str:
    """A short table for the terminal: one line per configuration on the first count cell."""
    rows = table["rows"]
    keys = sorted({r["cell"]["key"] for r in rows if not r["cell"]["timed"]})
    if not keys:
        return ""
    here = [r for r in rows if r["cell"]["key"] == keys[0]]
    workload = here[0]["cell"]["workload"]
    timed = {
        (r["config"], r["cell"]["batch"]): r
        for r in rows
        if r["cell"]["timed"] and r["cell"]["temperature"] == 0 and r["cell"]["workload"] == workload
    }
    batches = sorted({b for _, b in timed})
    head = f"{'config':28} {'tau':>5} {'discard':>7} {'verif':>6} {'S(c)':>6} {'S(c=4)':>6} {'lossless':>8}"
    head += "".join(f" {'wall b' + str(b):>9}" for b in batches)
    out = [f"{keys[0]}", head]
    for r in here:
        line = (
            f"{r['config'][:28]:28} {r['tau']:5.2f} {r['discard_rate']:7.2f} {r['verification_rate']:6.2f} "
            f"{_fmt(r['S_measured_c'], '.3f'):>6} {r['S_c4']:6.3f} {_fmt(r['lossless'], '.0%'):>8}"
        )
        for b in batches:
            t = timed.get((r["config"], b))
            line += f" {_fmt(t['speedup_vs_no_spec'] if t else None, '.2f') + 'x':>9}"
        out.append(line)
    for o in table["replay"]:
        if o["cell"]["key"] == keys[0] and o["oracle"] and o["k"] == max(x["k"] for x in table["replay"]):
            out.append(
                f"{'oracle (cap ' + str(o['k']) + ')':28} {o['tau']:5.2f} {o['discard_rate']:7.2f} "
                f"{o['verification_rate']:6.2f} {_fmt(o['S_measured_c'], '.3f'):>6} {o['S_c4']:6.3f}"
            )
    return "\n".join(out)


def write(results: list[dict], env: dict, out: Path, title: str) -> dict[str, Any]:
    from benchmarks.harness import plots

    table = tabulate(results)
    table["engine_costs"] = engine_costs(table)
    (out / "report.json").write_text(json.dumps({"environment": env, **table}, indent=1) + "\n")
    (out / "report.md").write_text(markdown(table, env, title) + plots.draw(table, out))
    return table
