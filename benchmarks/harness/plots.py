"""PNG plots of a harness run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated when both coordinates are better lower, sorted by x."""
    front, best_y = [], float("inf")
    for x, y in sorted(points):
        if y < best_y:
            front.append((x, y))
            best_y = y
    return front


def _families(rows: list[dict]) -> dict[str, list[dict]]:
    fam: dict[str, list[dict]] = {}
    for r in rows:
        if r["kind"] != "nospec":
            fam.setdefault(r["family"], []).append(r)
    return fam


def draw(table: dict[str, Any], out: Path) -> str:
    """Writes the plots under out/plots and returns the report's Markdown section for them."""
    rows, replay = table["rows"], table["replay"]
    (out / "plots").mkdir(exist_ok=True)
    md = ["", "## Plots", ""]
    for key in sorted({r["cell"]["key"] for r in rows if not r["cell"]["timed"]}):
        here = [r for r in rows if r["cell"]["key"] == key]
        slug = key.replace("/", "_")
        orc = [o for o in replay if o["cell"]["key"] == key and o["oracle"]]

        fig, ax = plt.subplots(figsize=(7, 5))
        for i, (family, members) in enumerate(sorted(_families(here).items())):
            pts = [(r["verification_rate"], r["discard_rate"]) for r in members]
            color = f"C{i % 10}"
            ax.scatter(*zip(*pts), color=color, label=family, s=18)
            if len(pts) > 1:
                ax.plot(*zip(*pareto(pts)), color=color, lw=1)
        if orc:
            ax.scatter(
                [o["verification_rate"] for o in orc],
                [o["discard_rate"] for o in orc],
                marker="x",
                color="black",
                label="oracle (cap K)",
                s=18,
            )
        ax.set_xlabel("verification rate N_T / N_gen (lower is better)")
        ax.set_ylabel("discard rate (N_D - N_acc) / N_gen (lower is better)")
        ax.set_title(f"Discard vs verification, {key}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "plots" / f"pareto_{slug}.png", dpi=110)
        plt.close(fig)

        sweeps = {f: m for f, m in _families(here).items() if sum(r["sweep"] is not None for r in m) > 1}
        fig, axes = plt.subplots(1, max(1, len(sweeps)), figsize=(3.2 * max(1, len(sweeps)), 3.2), squeeze=False)
        for ax, (family, members) in zip(axes[0], sorted(sweeps.items())):
            members = sorted((r for r in members if r["sweep"] is not None), key=lambda r: r["sweep"])
            xs = [r["sweep"] for r in members]
            ax.plot(xs, [r["S_c4"] for r in members], "o-", label="c = 4", ms=3)
            if all(r["S_measured_c"] is not None for r in members):
                ax.plot(xs, [r["S_measured_c"] for r in members], "s--", label="measured c", ms=3)
            ax.set_title(family, fontsize=9)
            ax.set_xlabel("K" if family == "fixed K" else "threshold", fontsize=8)
            ax.set_ylabel("modeled speedup", fontsize=8)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "plots" / f"speedup_{slug}.png", dpi=110)
        plt.close(fig)

        hist_rows = [r for r in here if r["kind"] == "plugin" and r["draft_len_hist"]]
        if hist_rows:
            n = len(hist_rows)
            cols = min(4, n)
            fig, axes = plt.subplots(
                (n + cols - 1) // cols, cols, figsize=(3 * cols, 2.3 * ((n + cols - 1) // cols)), squeeze=False
            )
            for ax in axes.flat[n:]:
                ax.axis("off")
            for ax, r in zip(axes.flat, hist_rows):
                hist = {int(k): v for k, v in r["draft_len_hist"].items()}
                ax.bar(list(hist), list(hist.values()), color="C0")
                ax.set_title(r["config"], fontsize=8)
                ax.tick_params(labelsize=7)
            fig.suptitle(f"Draft length per round (rounds), {key}", fontsize=9)
            fig.tight_layout()
            fig.savefig(out / "plots" / f"draft_lengths_{slug}.png", dpi=110)
            plt.close(fig)
            md.append(f"![draft lengths {key}](plots/draft_lengths_{slug}.png)")
        md += [f"![pareto {key}](plots/pareto_{slug}.png)", f"![speedup {key}](plots/speedup_{slug}.png)", ""]
    return "\n".join(md) + "\n"
