"""The exact counts of harness runs, priced with costs measured on a GPU (benchmarks.gpu_costs).

    .venv/bin/python -m benchmarks.gpu_model REPORT.json [REPORT.json ...] [--gpu DIR] [--loops FILE] \
        [--out benchmarks/results/gpu_model_h100] [--write-costs FILE]

The harness counts what each configuration does (target passes, draft forwards, engine steps; exact,
the same on any machine for greedy decoding); `gpu_costs` measured what those things cost on an H100
at Llama-3.1-8B sizes with an EAGLE-3 head. This prices the one with the other, for reports of
EAGLE-3 runs (the toy head's acceptance standing in for a real head's):

- batch 1, per request (rows whose decisions do not depend on the batch: vLLM's fixed K, the
  plugin's rows with the batch gate off, the replay's fixed K and oracle): time per token =
  (N_T x V1(1 + N_D / N_T) + N_drawn x t_D x (1 + f)) / N_gen, against V1(1) per token without
  speculation. V1: the batch-1 verification curve over tokens (a line through 1-9 tokens, held flat
  past 9: longer rounds are priced low); t_D: one step of vLLM's draft loop;
  f: the plugin's loop and policy per step above vLLM's loop, measured at batch 1 (the oracle: 0).
- per engine step, at each cell's batch (every row): steps x V(tokens per step) + draft forwards of
  the batch x t_D(rows per step) x (1 + f(rows)), against no speculation's steps x V(rows per step);
  gated rows also pay the batch gate's host work (benchmarks/results/gate_cost, this CPU's figures).
Policies the GPU run did not time take the nearest one's cost: adaedl svip's (an entropy per step),
heuristic and the gate alone the plugin's loop with `fixed`, vllm_av confidence's. Not priced: vLLM's
own host work per draft step, which a loop that waits for each step's decisions exposes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness.report import batch_forwards
from benchmarks.paths import REPO
from vllm_adaptive_spec.config import BASELINES
from vllm_adaptive_spec.policies.costs import non_decreasing

POLICY_OF_FAMILY = {
    "svip": "svip",
    "adaedl": "svip",
    "confidence": "confidence",
    "heuristic": "fixed",
    "gate": "fixed",
    "fixed": "fixed",
    "vllm_av": "confidence",
    "specdecpp": "specdecpp",
    "pacer": "pacer",
}
GATE_COST = REPO / "benchmarks" / "results" / "gate_cost" / "gate_cost.json"


def interp(points: list[list[float]], x: float) -> float:
    """Piecewise-linear through sorted [x, y] points; flat outside them."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def nondecreasing(points: list[list[float]]) -> list[list[float]]:
    """Least-squares non-decreasing fit of [x, y] points (the cost meter's pool adjacent violators), sorted by x."""
    pts = sorted(points)
    fit = non_decreasing([(x, y, 1) for x, y in pts])
    return [[x, round(v, 4)] for (x, _), v in zip(pts, fit)]


def line(points: list[list[float]]) -> list[list[float]]:
    """The least-squares line through [x, y] points, as its two end points."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    lo, hi = min(x for x, _ in points), max(x for x, _ in points)
    return [[lo, my + slope * (lo - mx)], [hi, my + slope * (hi - mx)]]


class GpuCosts:
    """The curves of one gpu_costs run (`folder`: its gpu_costs.json and costs.json) and the per-step
    loop costs of another (`loops`: a gpu_costs.json of the code as it is; None: the same run)."""

    def __init__(self, folder: Path, loops: Path | None = None):
        main = json.loads((folder / "gpu_costs.json").read_text())
        self.device = main["device"]
        # Single verification passes vary by up to 8% between neighbouring shapes (kernel choice):
        # batch 1 takes the least-squares line over its 1-9 tokens, the whole curve a non-decreasing fit.
        self.verify_b1 = line([[t, ms] for b, t, ms in main["verify_ms"] if b == 1])
        self.verify = nondecreasing(json.loads((folder / "costs.json").read_text())["verify_ms"])
        run = json.loads(loops.read_text()) if loops else main
        self.loop = {int(b): row for b, row in run["loop_ms_per_step"].items()}

    def t_draft(self, rows: float) -> float:
        """One step of vLLM's draft loop (the head's forward and its argmax) at `rows` rows, ms."""
        return interp([[b, row["vLLM loop"]] for b, row in self.loop.items()], rows)

    def share(self, policy: str, rows: float) -> float:
        """f: the plugin's loop with `policy`, per step, above vLLM's loop, at `rows` rows."""
        return interp([[b, row[f"plugin: {policy}"] / row["vLLM loop"] - 1.0] for b, row in self.loop.items()], rows)

    def cost_file(self) -> dict:
        """A cost file (policies.costs) for the plugin on this GPU: a draft step is one step of the plugin's
        loop (with `fixed`; a policy's own share comes on top), a pass the fitted verification curve."""
        steps = [[b, round(row["plugin: fixed"], 4)] for b, row in sorted(self.loop.items())]
        return {"draft_step_ms": steps, "verify_ms": self.verify}


def gate_ms(rows: float) -> tuple[float, float]:
    """The batch gate's host work at `rows` rows, ms: per draft step (after_step and the greedy
    gather) and per round (start, finish, grading), measured on this CPU (benchmarks.gate_cost)."""
    doc = json.loads(GATE_COST.read_text())["ms_per_draft_step"]
    per_step = [[int(b), v["gate after_step (per step)"] + v["greedy gather"]] for b, v in doc.items()]
    per_round = [[int(b), v["gate round of one step (start, step, finish, grading)"]] for b, v in doc.items()]
    return interp(per_step, rows), interp(per_round, rows)


def gated(config: dict) -> bool:
    """The batch gate may be on: a timed plugin row (sweeps run without it) of an adaptive policy, unless
    turned off. Rows run before the gate existed (some defaults of older reports) count as gated too:
    they are left out of the batch-1 column and charged the gate's host work per step."""
    adaptive = config.get("adaptive") or {}
    if config["kind"] != "plugin" or not config.get("timed"):
        return False
    return bool(adaptive.get("batch_aware", adaptive.get("policy") not in BASELINES))  # as config.py decides


def configs_of(report: Path) -> dict[str, dict]:
    """Configuration name -> the harness configuration, from the run's raw results beside its report."""
    docs = [json.loads(p.read_text()) for p in sorted((report.parent / "raw").glob("*.json"))]
    return {d["config"]["name"]: d["config"] for d in docs}


def policy_of(row: dict) -> str | None:
    """The GPU-timed policy whose cost the row pays; None for vLLM's rows and the oracle (no plugin)."""
    return POLICY_OF_FAMILY.get(row["family"]) if row["kind"] == "plugin" else None


def per_request(row: dict, g: GpuCosts, policy: str | None) -> float:
    """S at batch 1 from a row's (or replay entry's) per-request counts."""
    n_gen, n_t, n_d = row["n_gen"], row["n_target"], row["n_draft"]
    drawn = row["drawn_per_token"] * n_gen
    f = g.share(policy, 1) if policy else 0.0
    t = n_t * interp(g.verify_b1, 1 + n_d / n_t) + drawn * g.t_draft(1) * (1 + f)
    return interp(g.verify_b1, 1) * n_gen / t


def per_step(row: dict, ref: dict, g: GpuCosts, policy: str | None) -> float | None:
    """S per engine step at the cell's batch, from the row's engine steps and forwards."""
    fw = batch_forwards(row, row["cfg"])
    if fw is None or not row.get("steps") or not ref.get("steps"):
        return None
    rows = row["n_target"] / row["steps"]  # requests per engine step
    t = row["steps"] * interp(g.verify, (row["n_target"] + row["n_draft"]) / row["steps"])
    f = g.share(policy, rows) if policy else 0.0
    t += fw * g.t_draft(rows) * (1 + f)
    if gated(row["cfg"]):
        step_ms, round_ms = gate_ms(rows)
        t += fw * step_ms + row["steps"] * round_ms
    return ref["steps"] * interp(g.verify, ref["n_target"] / ref["steps"]) / t


def merge(paths: list[Path]) -> dict:
    """The rows (each with its configuration under "cfg") and replay entries of several reports of the
    same cells (a row already seen wins)."""
    rows, replay, seen = [], [], set()
    for path in paths:
        rep, configs = json.loads(path.read_text()), configs_of(path)
        for r in rep["rows"]:
            if (r["config"], r["cell"]["key"]) not in seen:
                seen.add((r["config"], r["cell"]["key"]))
                rows.append(r | {"cfg": configs[r["config"]]})
        have = {e["cell"]["key"] for e in replay}  # cells whose replay an earlier report gave
        replay += [e for e in rep.get("replay", []) if e["cell"]["key"] not in have]
    return {"rows": rows, "replay": replay}


def price(report: dict, g: GpuCosts) -> dict:
    """Every cell of a report: per-step S for each row; for count cells also batch-1 S per request."""
    methods = {r.get("method") for r in report["rows"]}
    if methods != {"eagle3"}:
        raise ValueError(f"gpu_model prices EAGLE-3 runs only (its draft step is an EAGLE-3 head's); got {methods}")
    cells: dict[str, dict] = {}
    for key in sorted({r["cell"]["key"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["cell"]["key"] == key]
        ref = next(r for r in rows if r["kind"] == "nospec")
        out = []
        for r in rows:
            policy = policy_of(r)
            entry = {"config": r["config"], "tau": round(r["tau"], 3), "gated": gated(r["cfg"]), "policy_cost": policy}
            entry["S_step"] = per_step(r, ref, g, policy)
            if not entry["gated"] and r["kind"] != "nospec" and "dynamic" not in r["config"]:
                entry["S_b1"] = per_request(r, g, policy)
                entry["S_b1_free"] = per_request(r, g, None)  # the rule alone: no loop or policy cost
            out.append(entry)
        replay = [e for e in report.get("replay", []) if e["cell"]["key"] == key]
        for e in replay:
            name = f"{'oracle' if e['oracle'] else 'fixed'} K={e['k']} (replay)"
            s_b1 = per_request(e, g, None)
            out.append({"config": name, "tau": round(e["tau"], 3), "S_b1": s_b1, "S_b1_free": s_b1})
        cells[key] = {"batch": rows[0]["cell"]["batch"], "rows": out} | summary(out)
    return cells


def not_tuned_on_report(name: str) -> bool:
    """Rows whose setting was not picked on the reported prompts: defaults, settings `tune` chose on
    training responses, the gate alone (a threshold sweep's best point is not a result)."""
    return "tuned on train" in name or "default" in name or name.startswith("batch gate alone")


def summary(rows: list[dict]) -> dict:
    """Best fixed K, best adaptive row (`not_tuned_on_report`) and the oracle at batch 1; the same per
    engine step (no oracle there)."""
    out = {}
    for col in ("S_b1", "S_b1_free", "S_step"):
        have = [r for r in rows if r.get(col) is not None]
        fixed = [r for r in have if r["config"].startswith(("vLLM K=", "fixed K="))]
        adaptive = [r for r in have if (r.get("policy_cost") or r.get("gated")) and not_tuned_on_report(r["config"])]
        oracle = [r for r in have if r["config"].startswith("oracle")]
        if not fixed or not adaptive:
            continue
        bf, ba = max(fixed, key=lambda r: r[col]), max(adaptive, key=lambda r: r[col])
        s = {"best_fixed": [bf["config"], round(bf[col], 4)], "best_adaptive": [ba["config"], round(ba[col], 4)]}
        s["adaptive_over_fixed"] = round(ba[col] / bf[col], 4)
        if oracle:
            bo = max(oracle, key=lambda r: r[col])
            s["oracle"] = [bo["config"], round(bo[col], 4)]
            s["oracle_share"] = round((ba[col] - bf[col]) / (bo[col] - bf[col]), 4)
        out[col] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--gpu", type=Path, default=REPO / "benchmarks" / "results" / "gpu_costs_h100")
    ap.add_argument(
        "--loops",
        type=Path,
        default=REPO / "benchmarks" / "results" / "gpu_costs_h100" / "graphs" / "gpu_costs.json",
        help="the gpu_costs.json whose per-step loop costs to charge (the code as it is)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_model_h100")
    ap.add_argument("--write-costs", type=Path, help="also write the plugin's cost file for this GPU here")
    args = ap.parse_args()
    g = GpuCosts(args.gpu, args.loops)
    if args.write_costs:
        args.write_costs.write_text(json.dumps(g.cost_file(), indent=1))
        print(f"saved {args.write_costs}")
    doc = {
        "gpu": {"device": g.device, "loops": str(args.loops), "t_draft_b1_ms": g.t_draft(1), "verify_b1": g.verify_b1},
        "c_b1": interp(g.verify_b1, 1) / g.t_draft(1),
        "shares_b1": {p: round(g.share(p, 1), 4) for p in ("fixed", "svip", "confidence", "specdecpp", "pacer")},
    }
    print(f"{g.device}: c at batch 1 = {doc['c_b1']:.2f}; f at batch 1 = {doc['shares_b1']}")
    merged = merge(args.reports)
    doc["reports"] = [str(p) for p in args.reports]
    doc["cells"] = cells = price(merged, g)
    for key, cell in cells.items():
        print(f"\n{key} (batch {cell['batch']})")
        for col in ("S_b1", "S_b1_free", "S_step"):
            if col in cell:
                print(f"  {col}: {cell[col]}")
        for r in sorted(cell["rows"], key=lambda r: -(r.get("S_b1") or r.get("S_step") or 0)):
            b1 = f"{r['S_b1']:.3f}" if r.get("S_b1") is not None else "  -  "
            st = f"{r['S_step']:.3f}" if r.get("S_step") is not None else "  -  "
            print(f"    {r['config'][:48]:48} tau {r['tau']:5.2f}  S_b1 {b1}  S_step {st}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_model.json").write_text(json.dumps(doc, indent=1))
    print(f"saved {args.out}/gpu_model.json")


if __name__ == "__main__":
    main()
