"""S per engine step at c = 4 for a harness run, with and without the policy's own time.

    .venv/bin/python -m benchmarks.per_step benchmarks/results/batched_eagle3_steady_flat_c4

The report's "S per step (c=4)" column charges each plugin row its measured policy share f
(`report.step_speedup`). Printed beside it, the same with f = 0: the rule's decisions alone, apart
from what its per-step work costs on this CPU. Per cell, the best adaptive row against the best fixed K
(the report's own kinds: `report.row_kinds`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness.report import best_by, policy_share, row_kinds, step_speedup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="a harness output folder (its raw/)")
    ap.add_argument("--c", type=float, default=4.0)
    args = ap.parse_args()
    results = [json.loads(p.read_text()) for p in sorted((args.out / "raw").glob("*.json"))]
    base = {row["cell"]["key"]: row for res in results if res["config"]["kind"] == "nospec" for row in res["cells"]}
    by_cell: dict[str, list[dict]] = {}
    for res in results:
        cfg = res["config"]
        for row in res["cells"]:
            ref = base.get(row["cell"]["key"])
            alone = step_speedup(row, ref, cfg, args.c, 0.0)
            if cfg["kind"] != "nospec" and alone is not None:
                by_cell.setdefault(row["cell"]["key"], []).append(
                    {
                        "config": cfg["name"],
                        "kind": cfg["kind"],
                        "family": cfg["family"],
                        "method": cfg.get("method") or "draft_model",
                        "alone": alone,
                        "charged": step_speedup(row, ref, cfg, args.c, policy_share(row)),
                    }
                )
    for cell, rows in sorted(by_cell.items()):
        print(cell)
        for r in rows:
            print(f"  {r['config']:32s} {r['alone']:.3f} (f = 0)  {r['charged']:.3f} (f charged)")
        kinds = row_kinds(rows)
        fixed, alone, charged = (
            best_by(kinds["fixed K"], "alone"),
            *(best_by(kinds["adaptive"], m) for m in ("alone", "charged")),
        )
        if fixed and alone:
            print(
                f"  best fixed K: {fixed['config']} {fixed['alone']:.3f}; best adaptive {alone['config']} "
                f"{alone['alone'] / fixed['alone']:.3f}x (f = 0), {charged['config']} "
                f"{charged['charged'] / fixed['alone']:.3f}x (f charged)"
            )


if __name__ == "__main__":
    main()
