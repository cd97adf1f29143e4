"""Interleaved timing: configurations take turns on the same prompts, so drift hits them alike.

Run one after another, configurations drifted 10-20% within minutes on the
shared 2-core machine, enough to invert rankings. Here every timed
configuration of a group keeps its own engine alive in its own process
(`serve`); the coordinator walks the cell's prompt groups (one `generate`
call of `batch` prompts each) and, for each, lets every configuration run it
in turn, rotating the order from one prompt group to the next. No
speculation is in every group of configurations, so each row carries paired
ratios: its tokens/s over no speculation's in the same repeat of the same
group. Memory decides the group size (one engine each); the no-speculation
rows of the groups, run at different times, show how much the machine
drifted.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness.plan import Cell, Config


def serve(config: dict, conn, log_path: str) -> None:
    """A configuration's engine, answering the coordinator's requests until told to close."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)
    try:
        from benchmarks import vllm_run
        from benchmarks.harness.worker import CellRun, add_prompt_ids, make_engine

        cfg = Config(**config)
        os.environ.update(cfg.env or {})  # before vLLM spawns its engine process, which inherits it
        llm = make_engine(cfg)
        conn.send(("ok", None))
        runs: dict[str, CellRun] = {}
        while True:
            op, *args = conn.recv()
            if op == "start":
                cell = Cell(**args[0])
                runs[cell.key] = CellRun(llm, cell, cfg.kind)
                conn.send(("ok", len(runs[cell.key].groups)))
            elif op == "group":
                key, repeat, g = args
                conn.send(("ok", runs[key].run_group(repeat, g)))
            elif op == "finish":
                row = runs.pop(args[0]).finish()
                if cfg.kind == "nospec":
                    add_prompt_ids(llm, [row])
                conn.send(("ok", row))
            elif op == "close":
                vllm_run.close_llm(llm)
                conn.send(("ok", None))
                return
    except Exception:
        conn.send(("error", traceback.format_exc()))


class Engine:
    """The coordinator's handle on one serving process."""

    def __init__(self, ctx, config: Config, log: Path):
        self.config = config
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(config.to_dict(), child, str(log)), daemon=False)
        self.proc.start()

    def ask(self, *msg: Any) -> Any:
        if msg:
            self.conn.send(msg)
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.config.name}: {value}")
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.ask("close")
        finally:
            self.proc.join(timeout=60)
            if self.proc.is_alive():
                self.proc.kill()


def groups_of(configs: list[Config], size: int) -> list[list[Config]]:
    """Groups of at most `size` configurations, no speculation first in every one."""
    base = [c for c in configs if c.kind == "nospec"]
    if len(base) != 1:
        raise ValueError("interleaved timing needs exactly one no-speculation configuration")
    others = [c for c in configs if c.kind != "nospec"]
    step = max(size - 1, 1)
    return [base + others[i : i + step] for i in range(0, len(others), step)] or [base]


def turn_order(n: int, turn: int) -> list[int]:
    """Who runs when in this turn: the order rotates by one every turn."""
    return [(turn + j) % n for j in range(n)]


def paired(row: dict, base: dict) -> dict:
    """Per-repeat tokens/s over no speculation's in the same repeat of the same group."""
    return row | {"paired_ratio": [a / b for a, b in zip(row["tokens_per_s"], base["tokens_per_s"])]}


def merge_lives(rows: list[dict]) -> dict:
    """One configuration's row of one cell from several engine lives (one repeat each): their repeats'
    seconds, speeds and paired ratios side by side, the policy's timing averaged; the counts are the
    first life's (greedy: every life generates the same tokens)."""
    out = dict(rows[0])
    for key in ("seconds", "tokens_per_s", "paired_ratio"):
        out[key] = [x for r in rows for x in r[key]]
    out["cell"] = rows[0]["cell"] | {"repeats": len(out["seconds"])}
    if rows[0].get("policy_timing"):
        out["policy_timing"] = {
            k: sum(r["policy_timing"][k] for r in rows) / len(rows) for k in rows[0]["policy_timing"]
        }
    out["engine_lives"] = len(rows)
    return out


def run_group(
    members: list[Config], cells: list[Cell], logs: Path, index: int, fresh: bool = False
) -> dict[str, list[dict]]:
    """Every timed cell on every member, interleaved; rows per configuration name. fresh: every repeat
    on new engines (all members started again), so each engine's own offset (where its process and
    memory landed: two engines of one configuration differ by a few percent through all their
    repeats) becomes one more thing the repeats sample instead of a bias of the row."""
    if fresh:
        lives = [
            _run_life(members, [replace(c, repeats=1) for c in cells], logs, index, f"_life{r}")
            for r in range(max(c.repeats for c in cells))
        ]
        return {c.name: [merge_lives([life[c.name][i] for life in lives]) for i in range(len(cells))] for c in members}
    return _run_life(members, cells, logs, index, "")


def _run_life(members: list[Config], cells: list[Cell], logs: Path, index: int, tag: str) -> dict[str, list[dict]]:
    ctx = mp.get_context("spawn")
    engines: list[Engine] = []
    rows: dict[str, list[dict]] = {c.name: [] for c in members}
    try:
        for cfg in members:  # one at a time: engines start faster without competing for the cores
            engines.append(Engine(ctx, cfg, logs / f"interleaved_g{index}_{_slug(cfg.name)}{tag}.log"))
            engines[-1].ask()
        for cell in cells:
            n_groups = [e.ask("start", cell.__dict__) for e in engines][0]
            turn = 0
            for repeat in range(cell.repeats):
                for g in range(n_groups):
                    for j in turn_order(len(engines), turn):
                        engines[j].ask("group", cell.key, repeat, g)
                    turn += 1
            finished = [e.ask("finish", cell.key) for e in engines]
            base = finished[0]
            for cfg, row in zip(members, finished):
                rows[cfg.name].append(paired(row, base) | {"interleave_group": index})
    finally:
        for e in engines:
            e.close()
    return rows


def _slug(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9.=]+", "_", name).strip("_")
