"""Batch-1 step table: what a step costs at each verified length on this machine, and whether that
explains the wall clock of rows that mix lengths.

The plugin's fixed rows (the regime's "plugin fixed K=k under cap 16", "plugin fixed K=16") draft
one length every step. Their clock splits each run into the draft side (`policy_timing.propose_s`,
the loop's own timer) and the rest: the target pass over 1 + m tokens, rejection sampling and the
engine's bookkeeping. Per fixed row, R(m) = (seconds - propose_s) / steps at m = its mean kept
drafts per step. Every plugin row on the cell is then predicted from its own draft side and its
histogram of kept lengths (with a context tail, of the tokens each round sent to verification: the
drafts and the tail after them), propose_s + sum_m hist[m] R(m), with R interpolated linearly between the
table's lengths (flat past the ends), and once more with R affine in m (least squares over the
table): the shape the step-cost model of the wall-clock section assumes. Where the table predicts a
row and the affine line does not, the gap comes from the cost curve's shape, not from the loop.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import numpy as np

EXPLAINED = (
    "The plugin's fixed rows draft one length m every step; their own clock splits each run into the draft "
    "side and the rest of the step (the target pass over 1 + m tokens, rejection sampling, bookkeeping): "
    "R(m) = (seconds - draft side) / steps. Every plugin row is predicted from its own draft side plus "
    "its histogram of kept lengths (with a context tail, drafts and tail tokens: what each pass verified) "
    "priced by R, interpolated between the table's lengths ('by the table'), "
    "and by a line fitted to the same points ('by the affine line', the shape the step-cost model above "
    "assumes). Where the table predicts a row and the line does not, the shape of the cost curve explains "
    "the gap, not the loop."
)


def hist_total(hist: dict) -> float:
    """sum of k * steps over a per-step histogram {k: steps} (keys as JSON strings or ints)."""
    return float(sum(int(k) * n for k, n in hist.items()))


def _lengths(row: dict) -> dict:
    """{m: rounds} of the tokens each round sent to verification: the drafts, and the context tail's
    tokens after them where the row ran one (its passes verify those too)."""
    return row.get("proposed_len_hist") or row.get("draft_len_hist") or {}


def _mean_kept(row: dict) -> float:
    hist = _lengths(row)
    steps = sum(hist.values())
    return hist_total(hist) / steps if steps else float("nan")


def _rest_per_step(row: dict) -> float:
    """Seconds per step outside the draft side (median run)."""
    return (statistics.median(row["seconds"]) - row["policy_timing"]["propose_s"]) / row["steps"]


def _is_fixed(row: dict) -> bool:
    return row.get("family") == "plugin fixed"


def table_points(rows: list[dict]) -> list[tuple[float, float, str]]:
    """(m, R(m) seconds, config) per fixed plugin row of one batch-1 cell, sorted by m."""
    pts = [
        (_mean_kept(r), _rest_per_step(r), r["config"])
        for r in rows
        if _is_fixed(r) and r.get("policy_timing") and r.get("steps")
    ]
    return sorted(p for p in pts if np.isfinite(p[0]))


def _rest(row: dict, pts: list[tuple[float, float, str]]) -> tuple[float, float]:
    """(by the table, by the affine fit) seconds of one run of the row outside its draft side: each
    round's tokens sent to verification priced by R."""
    ms = np.array([p[0] for p in pts])
    rs = np.array([p[1] for p in pts])
    slope, icept = np.polyfit(ms, rs, 1)
    hist = {int(m): n for m, n in _lengths(row).items()}
    lengths, counts = np.array(list(hist), dtype=float), np.array(list(hist.values()), dtype=float)
    return float(counts @ np.interp(lengths, ms, rs)), float(counts @ (icept + slope * lengths))


def predict(row: dict, pts: list[tuple[float, float, str]]) -> tuple[float, float]:
    """(by the table, by the affine fit) seconds of one run of the row, with its own measured draft side."""
    draft = row["policy_timing"]["propose_s"]
    by_table, by_line = _rest(row, pts)
    return draft + by_table, draft + by_line


def _forwards(row: dict) -> float:
    """Draft forwards of one run of the row."""
    return hist_total(row.get("draft_forwards_per_step") or {})


def _timed_fixed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if _is_fixed(r) and r.get("policy_timing") and r.get("steps") and _forwards(r)]


def draft_fit(rows: list[dict]) -> tuple[float, float] | None:
    """(seconds per round, seconds per draft forward): the fixed rows' draft side per step fitted as a line
    over their draft forwards per step; None without two draft lengths."""
    fixed = _timed_fixed(rows)
    if len({round(_forwards(r) / r["steps"], 1) for r in fixed}) < 2:
        return None
    fw = np.array([_forwards(r) / r["steps"] for r in fixed])
    side = np.array([r["policy_timing"]["propose_s"] / r["steps"] for r in fixed])
    per_forward, per_round = np.polyfit(fw, side, 1)
    return float(per_round), float(per_forward)


def predict_from_counts(row: dict, pts: list[tuple[float, float, str]], fit: tuple[float, float]) -> float:
    """Seconds of one run of the row from its counts alone: its steps, draft forwards and lengths sent to
    verification, each priced on the fixed rows (the draft side by `draft_fit`, the rest by the table)."""
    return fit[0] * row["steps"] + fit[1] * _forwards(row) + _rest(row, pts)[0]


def _has_table(pts: list[tuple[float, float, str]]) -> bool:
    """Whether a cell's fixed rows give a table: two lengths at least."""
    return len({round(m, 1) for m, _, _ in pts}) >= 2


def _priced(row: dict) -> bool:
    """Whether a row of a step-table cell is priced on the table (a plugin row with its own clock)."""
    return row["kind"] == "plugin" and bool(row.get("draft_len_hist")) and bool(row.get("policy_timing"))


def counts_speed_errors(rows: list[dict]) -> dict[str, float]:
    """Per priced plugin row of one batch-1 cell: its speed over no speculation priced from its counts alone
    on the cell's step table, over the measured one, less 1 (medians of runs); {} where the cell has no table
    (fewer than two fixed lengths, no draft fit, or no no-speculation row)."""
    pts, fit = table_points(rows), draft_fit(rows)
    if not _has_table(pts) or fit is None or not any(r["kind"] == "nospec" for r in rows):
        return {}
    return {
        r["config"]: statistics.median(r["seconds"]) / predict_from_counts(r, pts, fit) - 1.0
        for r in rows
        if _priced(r) and r.get("steps")
    }


def batch1_costs(rows: list[dict]) -> dict | None:
    """A cost file (`adaptive_spec.costs`, `tune --costs`) at one request from one batch-1 cell: each draft
    forward costs the slope b of the fixed rows' draft side over their forwards per step; a pass over
    1 + m tokens costs a fixed row's step time less its forwards at b (the draft side's per-round part
    stays in it), a pass over 1 token a step of no speculation. None without two fixed rows."""
    fit = draft_fit(rows)
    nospec = next((r for r in rows if r["kind"] == "nospec"), None)
    if fit is None or nospec is None:
        return None  # a slope needs two draft lengths
    fixed, b = _timed_fixed(rows), fit[1]
    verify = [[1.0, 1e3 * statistics.median(nospec["seconds"]) / nospec["steps"]]]
    for r in sorted(fixed, key=_mean_kept):
        ms = 1e3 * (statistics.median(r["seconds"]) - b * _forwards(r)) / r["steps"]
        verify.append([round(1 + _mean_kept(r), 2), round(ms, 4)])
    return {"draft_step_ms": [[1, round(1e3 * b, 4)]], "verify_ms": verify}


def block_costs(rows: list[dict]) -> dict | None:
    """The same file from a block drafter's batch-1 cell (DFlash: one draft forward per round, whatever it
    verifies): the round's draft side, the median over the plugin rows of their loop's time per round
    less their policy's (`draft_step_ms`: the block's forward and its logits), and a pass over 1 + m tokens,
    m the drafts a fixed row (vLLM's or the plugin's) verified per step, at its step time less that draft
    side; a pass over 1 token a step of no speculation. None without a plugin row and a fixed row."""
    timing = [t for r in rows if r["kind"] == "plugin" and (t := r.get("policy_timing") or {}).get("rounds")]
    fixed = [r for r in rows if r.get("family") in ("fixed K", "plugin fixed") and r.get("steps") and r.get("n_draft")]
    nospec = next((r for r in rows if r["kind"] == "nospec"), None)
    if not timing or not fixed or nospec is None:
        return None
    draft = statistics.median((t["propose_s"] - t["policy_s"]) / t["rounds"] for t in timing)
    verify = [[1.0, 1e3 * statistics.median(nospec["seconds"]) / nospec["steps"]]]
    for r in sorted(fixed, key=lambda r: r["n_draft"] / r["steps"]):
        ms = 1e3 * (statistics.median(r["seconds"]) / r["steps"] - draft)
        verify.append([round(1 + r["n_draft"] / r["steps"], 2), round(ms, 4)])
    return {"draft_step_ms": [[1, round(1e3 * draft, 4)]], "verify_ms": verify}


def write_costs(table: dict[str, Any], out) -> list:
    """step_costs_<workload>.json in `out` for every timed batch-1 cell with a step table."""
    rows = [r for r in table["rows"] if r["cell"]["timed"] and r["cell"]["batch"] == 1]
    written = []
    for key in sorted({r["cell"]["key"] for r in rows}):
        here = [r for r in rows if r["cell"]["key"] == key]
        costs = block_costs(here) if any(r.get("method") == "dflash" for r in here) else batch1_costs(here)
        if costs:
            path = out / f"step_costs_{key.split('/')[1]}.json"
            path.write_text(json.dumps(costs, indent=1) + "\n")
            written.append(path)
    return written


def step_table_section(table: dict[str, Any]) -> list[str]:
    rows = [r for r in table["rows"] if r["cell"]["timed"] and r["cell"]["batch"] == 1]
    keys = sorted({r["cell"]["key"] for r in rows})
    lines: list[str] = []
    for key in keys:
        here = [r for r in rows if r["cell"]["key"] == key]
        pts = table_points(here)
        if not _has_table(pts):
            continue  # a table needs two lengths
        if not lines:
            lines = ["", "## Step table at batch 1: cost per verified length, and what it predicts", "", EXPLAINED]
        nospec = next((r for r in here if r["kind"] == "nospec"), None)
        t_t = statistics.median(nospec["seconds"]) / nospec["steps"] if nospec else float("nan")
        lines += [
            "",
            f"{key.removeprefix('timed/')}: no speculation {1e3 * t_t:.2f} ms per step",
            "",
            "| from | drafts kept per step m | rest of the step (ms) | in t_T |",
            "|---|---|---|---|",
        ]
        lines += [f"| {name} | {m:.2f} | {1e3 * r:.2f} | {r / t_t:.2f} |" for m, r, name in pts]
        lines += [
            "",
            f"As a cost file (`tune --costs`, `adaptive_spec.costs`): step_costs_{key.split('/')[1]}.json, "
            "each draft forward at the slope of the fixed rows' draft side over their forwards.",
            "",
            COUNTS_EXPLAINED,
            "",
            "| config | drafts kept per step | measured s/run | by the table | error | by the affine line | error "
            "| from counts | error | x no speculation: measured / from counts |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        fit = draft_fit(here)
        for r in here:
            if not _priced(r):
                continue
            meas = statistics.median(r["seconds"])
            tab, lin = predict(r, pts)
            line = f"| {r['config']} | {_mean_kept(r):.2f} | {meas:.3f} | {tab:.3f} | {(tab - meas) / meas:+.1%} | "
            line += f"{lin:.3f} | {(lin - meas) / meas:+.1%} |"
            if fit is None or nospec is None or not r.get("steps"):
                lines.append(line + " - | - | - |")
                continue
            est, t_ns = predict_from_counts(r, pts, fit), statistics.median(nospec["seconds"])
            lines.append(line + f" {est:.3f} | {(est - meas) / meas:+.1%} | {t_ns / meas:.3f} / {t_ns / est:.3f} |")
    return lines


COUNTS_EXPLAINED = (
    "'From counts' prices a row from its counts alone, on this cell's fixed rows: its steps and draft "
    "forwards at the line the fixed rows' draft side per step makes over their forwards per step, and the "
    "tokens each round sent to verification by the table; then the speed over no speculation, measured "
    "(medians of runs, not paired per repeat) and so modeled."
)


SPLIT_EXPLAINED = (
    "Each plugin row's step split by its own clock (per target pass, median run): the wall clock, the "
    "draft side, and the rest; then, on steady decode rounds (the same request as the round before), the "
    "engine's time from one round's drafts to the next round's start ('gap': the target's forward, "
    "sampling, scheduling, the engine's output) and the target's forward inside it; 'gc' is the engine "
    "process's garbage collection per pass. Where 'rest' grows and 'gap' does not, the time is spent "
    "outside the engine's steady steps (prefills, the front end, waiting)."
)


def step_split_section(table: dict[str, Any]) -> list[str]:
    rows = [
        r
        for r in table["rows"]
        if r["cell"]["timed"] and r["cell"]["batch"] == 1 and (r.get("policy_timing") or {}).get("steady_rounds")
    ]
    if not rows:
        return []
    lines = ["", "## Where a step goes at batch 1 (the plugin's clock)", "", SPLIT_EXPLAINED]
    for key in sorted({r["cell"]["key"] for r in rows}):
        lines += [
            "",
            key.removeprefix("timed/"),
            "",
            "| config | drafts kept per step | wall (ms/pass) | draft side | rest | steady gap | target forward "
            "| gap - target | gc |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["cell"]["key"] == key):
            t, steps = r["policy_timing"], r["steps"]
            wall, draft = 1e3 * statistics.median(r["seconds"]) / steps, 1e3 * t["propose_s"] / steps
            gap, target = (1e3 * t[k] / t["steady_rounds"] for k in ("steady_gap_s", "steady_target_s"))
            lines.append(
                f"| {r['config']} | {_mean_kept(r):.2f} | {wall:.2f} | {draft:.2f} | {wall - draft:.2f} | "
                f"{gap:.2f} | {target:.2f} | {gap - target:.2f} | {1e3 * t['gc_s'] / steps:.3f} |"
            )
    return lines
