"""The benchmark harness's arithmetic and report, on hand-made worker results."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness import plots, report
from benchmarks.harness.plan import batch_plan, eagle3_head_configs, full_plan, regime_plan, short_plan


def _cell(key_kind: str, batch: int, temperature: float = 0.0) -> dict:
    cell = {"workload": "code_heldout", "batch": batch, "temperature": temperature, "n_prompts": 2,
            "max_tokens": 8, "repeats": 2, "timed": key_kind == "timed"}  # fmt: skip
    return cell | {"key": f"{key_kind}/code_heldout/b{batch}/t{temperature:g}"}


def _row(cell: dict, seconds: float, steps: int, n_gen=16, n_draft=0, n_acc=0, hashes=("a", "b")) -> dict:
    return {"cell": cell, "seconds": [seconds * 0.9, seconds, seconds * 1.1],
        "tokens_per_s": [n_gen / seconds / f for f in (0.9, 1.0, 1.1)],
            "n_gen": n_gen, "n_target": n_gen - n_acc, "n_draft": n_draft, "n_accepted": n_acc, "steps": steps,
            "draft_len_hist": {}, "output_hashes": list(hashes)}  # fmt: skip


def _cfg(name: str, kind: str, family: str, k: int = 0) -> dict:
    return {"name": name, "kind": kind, "family": family, "k": k, "adaptive": None, "dynamic": None, "hf": None,
            "sweep": k or None, "timed": True}  # fmt: skip


def _results() -> list[dict]:
    timed, count = _cell("timed", 1), _cell("count", 8)
    # t_T = 2 ms per step; a K-step costs 3 ms + 0.5 ms * K  -> t_D = 0.5 ms, c = 4
    return [
        {"config": _cfg("no speculation", "nospec", "no speculation"),
         "cells": [_row(timed, 0.032, 16), _row(count, 0.1, 16)]},
        {"config": _cfg("vLLM K=2", "vllm", "fixed K", 2),
         "cells": [_row(timed, 0.004 * 8, 8, n_draft=16, n_acc=8), _row(count, 0.1, 8, n_draft=16, n_acc=8)]},
        {"config": _cfg("vLLM K=4", "vllm", "fixed K", 4),
         "cells": [_row(timed, 0.005 * 8, 8, n_draft=32, n_acc=8, hashes=("a", "x")),
                   _row(count, 0.1, 8, n_draft=32, n_acc=8, hashes=("a", "x"))]},
        {"config": _cfg("oracle", "oracle", "oracle"),
         "replay": [{"cell": count, "k": 2, "oracle": True, "n_gen": 16, "n_target": 6, "n_draft": 10,
                     "n_accepted": 10}]},
    ]  # fmt: skip


def test_derive_uses_algorithms_definitions():
    r = report.derive({"n_gen": 20, "n_target": 10, "n_draft": 12, "n_accepted": 10})
    assert r["tau"] == 2.0 and r["discard_rate"] == pytest.approx(0.1)
    assert r["verification_rate"] == 0.5 and r["draft_per_token"] == pytest.approx(0.6)


def test_cost_ratio_is_fit_from_fixed_k_step_times():
    ratios = report.cost_ratios(_results())
    r = ratios["timed/code_heldout/b1/t0"]
    assert r["t_target_s"] == pytest.approx(0.002)
    assert r["t_draft_s"] == pytest.approx(0.0005)
    assert r["t_spec_fixed_s"] == pytest.approx(0.003)
    assert r["c"] == pytest.approx(4.0)


def test_tabulate_speedups_and_lossless():
    table = report.tabulate(_results())
    rows = {(r["config"], r["cell"]["key"]): r for r in table["rows"]}
    k2 = rows[("vLLM K=2", "count/code_heldout/b8/t0")]
    # S = 1 / (N_T/N_gen + N_D/N_gen / c) = 1 / (0.5 + 1.0 / 4)
    assert k2["S_c4"] == pytest.approx(1 / 0.75)
    assert k2["S_measured_c"] == pytest.approx(1 / 0.75)  # the count cell borrows the closest timed cell's c
    assert k2["lossless"] == 1.0
    assert rows[("vLLM K=4", "count/code_heldout/b8/t0")]["lossless"] == 0.5
    assert rows[("vLLM K=2", "timed/code_heldout/b1/t0")]["speedup_vs_no_spec"] == pytest.approx(1.0)
    (orc,) = table["replay"]
    assert orc["S_c4"] == pytest.approx(1 / (6 / 16 + 10 / 16 / 4))


def test_dflash_is_charged_one_draft_forward_per_target_pass():
    """A DFlash block is drawn in one forward: its rows pay N_T draft forwards whatever the block length
    (cutting the block saves verification only), no speculation pays none, and no c is fit over K."""
    results = [{**res, "config": res["config"] | {"method": "dflash"}} for res in _results()]
    table = report.tabulate(results)
    assert table["cost_ratios"] == {}
    rows = {(r["config"], r["cell"]["key"]): r for r in table["rows"]}
    k4 = rows[("vLLM K=4", "count/code_heldout/b8/t0")]  # N_gen 16, N_T 8, N_D 32
    assert k4["S_c4"] == pytest.approx(1 / (8 / 16 + 8 / 16 / 4))
    assert rows[("no speculation", "count/code_heldout/b8/t0")]["S_c4"] == pytest.approx(1.0)
    (orc,) = table["replay"]
    assert orc["S_c4"] == pytest.approx(1 / (6 / 16 + 6 / 16 / 4))


def test_report_and_plots_are_written(tmp_path):
    table = report.write(_results(), {"summary": "test machine"}, tmp_path, "t")
    md = (tmp_path / "report.md").read_text()
    assert "best fixed K at c = 4: vLLM K=2" in md
    assert (tmp_path / "report.json").exists()
    assert (tmp_path / "plots" / "pareto_count_code_heldout_b8_t0.png").stat().st_size > 1000
    assert "vLLM K=2" in report.headline(table)


def test_pareto_front():
    pts = [(0.5, 0.4), (0.4, 1.0), (0.45, 1.2), (0.6, 0.1), (0.6, 0.3)]
    assert plots.pareto(pts) == [(0.4, 1.0), (0.5, 0.4), (0.6, 0.1)]


def test_another_drafters_rows_stay_out_of_the_cost_ratio_and_comparisons():
    """The short plan runs the EAGLE-3 head beside the draft model: its fixed-K step times must not enter
    the draft model's t_D, it gets no S at the draft model's c, and best_of_kinds compares one drafter."""
    results = _results()
    timed = _cell("timed", 1)
    eagle = _cfg("EAGLE-3 vLLM K=4", "vllm", "eagle3 fixed K", 4) | {"method": "eagle3"}
    results.append({"config": eagle, "cells": [_row(timed, 0.5, 8, n_draft=32, n_acc=10)]})
    eagle_policy = _cfg("EAGLE-3 confidence", "plugin", "eagle3 confidence", 16) | {"method": "eagle3"}
    results.append({"config": eagle_policy, "cells": [_row(timed, 0.001, 4, n_draft=20, n_acc=11)]})
    assert report.cost_ratios(results)["timed/code_heldout/b1/t0"]["c"] == pytest.approx(4.0)
    rows = [r for r in report.tabulate(results)["rows"] if r["cell"]["key"] == timed["key"]]
    assert {r["config"]: r["S_measured_c"] is None for r in rows if r["method"] == "eagle3"} == {
        "EAGLE-3 vLLM K=4": True,
        "EAGLE-3 confidence": True,
    }
    assert not any("EAGLE-3" in line for line in report.best_of_kinds(rows))
    assert {c.method for c in short_plan().configs} == {"draft_model", "eagle3"}


def test_plans_cover_the_issue():
    full = full_plan()
    kinds = {c.kind for c in full.configs}
    assert kinds >= {"nospec", "vllm", "plugin", "hf", "oracle"}
    assert sorted(c.k for c in full.configs if c.family == "fixed K") == [1, 2, 3, 4, 6, 8, 12, 16]
    assert {c.batch for c in full.cells} == {1, 4, 16, 32}
    assert {c.workload for c in full.cells} == {"code_heldout", "prose_heldout"}
    assert len({c.name for c in full.configs}) == len(full.configs)
    assert {c.kind for c in short_plan().configs} >= {"nospec", "vllm", "plugin", "oracle"}


def test_headline_reads_timed_cells_of_its_own_workload():
    """Regression: the headline's wall-clock columns mixed in another prompt family's cells."""
    results = _results()
    prose = _cell("timed", 1) | {"workload": "prose_heldout", "key": "timed/prose_heldout/b1/t0"}
    results[0]["cells"].append(_row(prose, 0.032, 16))
    results[1]["cells"].append(_row(prose, 0.064, 8, n_draft=16, n_acc=8))  # K=2 twice as slow on prose
    line = next(x for x in report.headline(report.tabulate(results)).splitlines() if x.startswith("vLLM K=2"))
    assert line.split()[-1] == "1.00x", line


def test_policy_cost_is_charged_from_the_cells_own_timing():
    """One cost scale: f comes from the policy timing stored with the row (same passes, same batch size),
    never from a batch-1 figure or a re-timing when the report is rebuilt."""
    results = _results()
    count = _cell("count", 8)
    plugin = _row(count, 0.1, 8, n_draft=16, n_acc=8) | {
        "policy_timing": {"policy_s": 0.02, "propose_s": 0.22, "decides": 400, "rounds": 100}
    }
    cfg = _cfg("svip", "plugin", "svip", 16)
    results.insert(-1, {"config": cfg, "cells": [plugin | {"cell": _cell("timed", 1)}, plugin]})
    table = report.tabulate(results)
    row = next(r for r in table["rows"] if r["config"] == "svip" and r["cell"]["key"] == count["key"])
    # f = 0.02 / (0.22 - 0.02) = 0.1 of the rest of the draft side; N_T/N_gen 0.5, N_D/N_gen 1, c = 4
    assert row["policy_cost_frac_of_draft_step"] == pytest.approx(0.1)
    assert row["policy_us_per_draft_step"] == pytest.approx(50.0)
    assert row["S_c4"] == pytest.approx(1 / (0.5 + 0.25 + 0.1 * 1.0 / 4))
    assert "| svip | 10.0% (50 us) | 10.0% (50 us) |" in "\n".join(report.policy_cost_section(table))
    k2 = next(r for r in table["rows"] if r["config"] == "vLLM K=2" and r["cell"]["key"] == count["key"])
    assert k2["policy_cost_frac_of_draft_step"] == 0.0


def test_speedup_per_engine_step_charges_each_draft_forward_of_the_batch():
    """S per step (c = 4): no speculation's steps over steps + draft forwards / 4 (the policy's share on
    top); vLLM's loop runs K forwards a step, the plugin's come from its per-step record."""
    results = _results()
    timed = _cell("timed", 1)
    plugin = _row(timed, 0.03, 5, n_draft=16, n_acc=11) | {
        "draft_forwards_per_step": {"1": 3, "3": 2},  # 9 forwards over 5 steps
        "policy_timing": {"policy_s": 0.01, "propose_s": 0.11, "decides": 9, "rounds": 5},  # f = 0.1
    }
    results.insert(-1, {"config": _cfg("gate", "plugin", "gate", 16), "cells": [plugin]})
    dynamic = _cfg("vLLM dynamic SD", "vllm", "vLLM dynamic", 3) | {"dynamic": [[1, 64, 3]]}
    results.insert(-1, {"config": dynamic, "cells": [_row(timed, 0.03, 8, n_draft=16, n_acc=8)]})
    rows = {r["config"]: r for r in report.tabulate(results)["rows"] if r["cell"]["key"] == timed["key"]}
    assert rows["no speculation"]["S_batch_c4"] == pytest.approx(1.0)
    assert rows["vLLM K=2"]["S_batch_c4"] == pytest.approx(16 / (8 + 2 * 8 / 4))
    assert rows["gate"]["S_batch_c4"] == pytest.approx(16 / (5 + 9 * 1.1 / 4))
    assert rows["vLLM dynamic SD"]["S_batch_c4"] is None  # its K moves with the batch: not modeled
    assert any("S per engine step at c = 4" in line for line in report.best_of_kinds(list(rows.values())))


def test_per_step_prints_the_rule_alone_and_with_its_time_charged(tmp_path, capsys, monkeypatch):
    """benchmarks.per_step: S per engine step at c = 4 with f = 0 beside f charged, and per cell the best
    adaptive row against the best fixed K."""
    from benchmarks import per_step

    timed = _cell("timed", 1)
    plugin = _row(timed, 0.03, 5, n_draft=16, n_acc=11) | {
        "draft_forwards_per_step": {"1": 3, "3": 2},  # 9 forwards over 5 steps
        "policy_timing": {"policy_s": 0.01, "propose_s": 0.11, "decides": 9, "rounds": 5},  # f = 0.1
    }
    results = [*_results()[:2], {"config": _cfg("gate", "plugin", "gate", 16), "cells": [plugin]}]
    (tmp_path / "raw").mkdir()
    for i, res in enumerate(results):
        (tmp_path / "raw" / f"{i}.json").write_text(json.dumps(res))
    monkeypatch.setattr("sys.argv", ["per_step", str(tmp_path)])
    per_step.main()
    out = capsys.readouterr().out
    k2, alone, charged = 16 / (8 + 2 * 8 / 4), 16 / (5 + 9 / 4), 16 / (5 + 9 * 1.1 / 4)
    assert f"{alone:.3f} (f = 0)  {charged:.3f} (f charged)" in out
    assert f"best fixed K: vLLM K=2 {k2:.3f}; best adaptive gate {alone / k2:.3f}x (f = 0)" in out


def test_changes_section_compares_with_an_earlier_report():
    table = report.tabulate(_results())
    old = json.loads(json.dumps(table))
    for r in old["rows"]:
        r["tau"] *= 1.1
    old["environment"] = {"commit": "abc1234", "date": "yesterday"}
    md = "\n".join(report.changes_section(table, old))
    assert "commit abc1234" in md and "| vLLM K=2 | 2.200 -> 2.000 (-9.1%) |" in md


def test_pacer_ablations_change_one_setting_on_code_count_cells_only():
    plan = full_plan()
    abl = [c for c in plan.configs if c.family == "pacer ablation"]
    if not abl:
        pytest.skip("no bundled Pacer layer")
    names = {c.name for c in abl}
    assert {f"pacer ablation block={b}" for b in (1, 3, 4, 5, 6, 7)} <= names
    assert {"pacer ablation halting=any", "pacer ablation growth=1.05", "pacer ablation context=full"} <= names
    for c in abl:
        assert not c.timed and [x.key for x in plan.cells_for(c)] == ["count/code_heldout/b32/t0"]
        assert c.adaptive["batch_aware"] is False  # the layer's rule, not the gate's
        changed = set(c.adaptive) - {"policy", "head", "batch_aware"}
        assert len(changed) == 1 or c.name.startswith(("pacer ablation position=", "pacer ablation none"))


def test_threshold_sweeps_run_without_the_gate_and_defaults_with_it():
    plan = full_plan()
    plugin = [c for c in plan.configs if c.kind == "plugin" and c.adaptive["policy"] not in ("fixed", "vllm_av")]
    for c in plugin:
        gate = c.adaptive.get("batch_aware", True)
        assert gate == (c.timed and "no batch gate" not in c.name), c.name


def test_eagle3_rows_and_their_regime_variant():
    counts, regime = eagle3_head_configs(), eagle3_head_configs(regime=True)
    assert len({c.name for c in counts}) == len(counts)
    tuned = [c for c in counts if "tuned on train" in c.name]
    assert {c.name.split("c=")[1] for c in tuned} == {"4)", "12)", "17)"}  # the three bundled tune files
    for c in counts:  # as the draft model's rows: sweeps and ablations gate off, each head's default gated
        gate = c.adaptive.get("batch_aware", True)
        assert gate == (c.timed and "no batch gate" not in c.name), c.name
    # the regime times each head with and without the gate and the tuned rows; no sweeps
    assert all(c.timed for c in regime)
    gated = {c.name.replace(" (tuned", " gated (tuned") for c in tuned}  # the tuned rules with the gate on
    capped = {f"{c.name}, cap 8" for c in tuned}  # ... and alone under a cap of 8
    floors = {f"{c.name}, min {n} drafts" for c in tuned for n in (2, 4)}  # ... and above a floor of drafts
    tails = {f"{c.name}, context tail {m}" for c in tuned for m in (4, 8, 15)}  # ... and with the context tail
    gated_tails = {f"{n}, context tail 4" for n in gated}  # ... and gated with a short tail (batched)
    # ... with the tail gate and without, and on the costs measured as it runs
    gated_tails |= {f"{n}, {v}" for n in gated_tails for v in ("no tail gate", "online costs")}
    expected = {c.name for c in counts if c.sweep is None or c in tuned} | gated | capped | floors | tails
    expected |= gated_tails
    pairs = ((4, 2), (4, 3), (4, 4), (2, 2))  # ... and with both: (context_tail, min_drafts)
    tail_floors = {f"{c.name}, context tail {m}, min {n} drafts": (m, n) for c in tuned for m, n in pairs}
    expected |= set(tail_floors)
    capped_tails = {  # ... and under a low cap: (context_tail, min_drafts, cap K)
        f"{c.name}, context tail {m}" + (f", min {n} drafts" if n else "") + f", cap {k}": (m, n, k)
        for c in tuned
        for m, n, k in ((4, 0, 4), (4, 2, 4), (4, 3, 4), (4, 2, 5))
    }
    expected |= set(capped_tails)
    assert {c.name for c in regime} == expected
    by_name = {c.name: c for c in regime}
    assert all(by_name[n].adaptive["min_drafts"] == int(n[-8]) for n in floors)
    assert all(by_name[n].adaptive["context_tail"] == int(n.split()[-1]) and by_name[n].k == 16 for n in tails)
    assert all(c.adaptive.get("batch_aware", True) for c in regime if c.name in gated | gated_tails)
    assert all(by_name[n].adaptive["context_tail"] == 4 for n in gated_tails)
    assert all(
        (by_name[n].adaptive["context_tail"], by_name[n].adaptive["min_drafts"]) == pair
        for n, pair in tail_floors.items()
    )
    assert all(by_name[n].adaptive["tail_gate"] == ("no tail gate" not in n) for n in gated_tails)
    assert all((by_name[n].adaptive.get("costs") == "online") == ("online" in n) for n in gated_tails)
    assert all(c.k == 8 and c.adaptive.get("batch_aware") is False for c in regime if c.name in capped)
    assert all(
        (by_name[x].adaptive["context_tail"], by_name[x].adaptive.get("min_drafts", 0), by_name[x].k) == mnk
        for x, mnk in capped_tails.items()
    )
    assert {"svip (no batch gate)", "confidence (no batch gate)"} <= {c.name for c in regime_plan().configs}
    ahead = {c.name: c for c in regime_plan().configs}["svip h=0.3, prepared ahead"]
    assert ahead.timed and ahead.adaptive == {"policy": "svip", "prepare_ahead": True}
    under = {c.name: c for c in regime_plan().configs}["plugin fixed K=4 under cap 16"]
    assert under.timed and under.k == 16 and under.adaptive == {"policy": "fixed", "k": 4}
    curve = [c for c in regime_plan().configs if c.name.endswith("under cap 16")]  # the step table's rows
    assert sorted(c.adaptive["k"] for c in curve) == [1, 2, 3, 4, 6, 8, 12] and all(c.k == 16 for c in curve)
    twin = {c.name: c for c in regime_plan().configs}["vLLM K=4 (twin engine)"]
    assert twin.kind == "vllm" and twin.k == 4 and twin.family != "fixed K"  # never the best fixed K
    # vLLM's prompt lookup, beside any drafter (its rows keep method "ngram"), and the draft model's tail rows
    regime = {c.name: c for c in regime_plan().configs}
    assert all(regime[f"vLLM ngram K={k}"].method == "ngram" and regime[f"vLLM ngram K={k}"].timed for k in (8, 16))
    assert regime["copy 0.7, context tail 15"].adaptive == {"policy": "copy", "context_tail": 15}


def test_batched_plan_times_the_eagle3_tuned_rules_and_fixed_k_to_4():
    import argparse

    from benchmarks.harness.__main__ import use_drafter

    plan = batch_plan()
    assert sorted(c.k for c in plan.configs if c.family == "fixed K") == [1, 2, 3, 4]
    # the plugin's own loop at vLLM K=1's and K=2's settings, gate off
    loop = [c for c in plan.configs if c.family == "plugin fixed"]
    assert [(c.k, c.adaptive) for c in loop] == [(1, {"policy": "fixed"}), (2, {"policy": "fixed"})]
    # copy with the context tail: both gates on the bundled curves, the tail gate off, each on measured costs
    tails = {c.name: c.adaptive for c in plan.configs if "context tail" in c.name}
    tail = {"policy": "copy", "context_tail": 4}
    assert tails == {
        "copy 0.7, context tail 4": tail | {"tail_gate": True},
        "copy 0.7, context tail 4, no tail gate": tail | {"tail_gate": False},
        # a round the gate verifies no draft in runs the first pass and verifies tails, as before 2026-12-07
        "copy 0.7, context tail 4, no tail gate, first pass every round": tail
        | {"tail_gate": False, "skip_first_pass": False},
        "copy 0.7, context tail 4, online costs": tail | {"tail_gate": True, "costs": "online"},
        "copy 0.7, context tail 4, no tail gate, online costs": tail | {"tail_gate": False, "costs": "online"},
    }
    use_drafter(argparse.Namespace(drafter="eagle3", regime=False, batched=True), plan)
    names = {c.name for c in plan.configs}
    assert {"confidence 0.75 (tuned on train, c=4)", "confidence 0.75 gated (tuned on train, c=4)"} <= names
    assert all(c.timed and c.method == ("ngram" if "ngram" in c.name else "eagle3") for c in plan.configs)
    assert all(plan.cells_for(c) for c in plan.configs)  # every row runs the batched cells
    # a busy endpoint: about 8 requests per slot, at most the family's 200 held-out prompts
    assert {(c.batch, c.n_prompts) for c in batch_plan(steady=True).cells} == {(4, 32), (16, 128), (32, 200)}


def test_prompt_lookup_rows_stay_prompt_lookup_on_any_drafter():
    import argparse

    from benchmarks.harness.__main__ import use_drafter

    plan = regime_plan()
    use_drafter(argparse.Namespace(drafter="eagle3", regime=True, batched=False), plan)
    methods = {c.name: c.method for c in plan.configs}
    assert methods["vLLM ngram K=8"] == methods["vLLM ngram K=16"] == "ngram" and methods["vLLM K=4"] == "eagle3"
    assert "confidence 0.75 (tuned on train, c=4), context tail 15" in methods


def test_interleaved_groups_rotation_and_pairing():
    from benchmarks.harness.interleaved import groups_of, paired, turn_order
    from benchmarks.harness.plan import Config

    cfgs = [Config(f"c{i}", "vllm", "fixed K", i) for i in range(1, 6)] + [Config("none", "nospec", "none")]
    groups = groups_of(cfgs, 3)
    assert [[c.name for c in g] for g in groups] == [["none", "c1", "c2"], ["none", "c3", "c4"], ["none", "c5"]]
    with pytest.raises(ValueError, match="no-speculation"):
        groups_of(cfgs[:2], 3)
    # every configuration takes every place in the order as the turns go by
    orders = [turn_order(3, t) for t in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert {o[0] for o in orders} == {0, 1, 2}
    row = paired({"tokens_per_s": [200.0, 90.0]}, {"tokens_per_s": [100.0, 100.0]})
    assert row["paired_ratio"] == [2.0, 0.9]


def test_wall_clock_uses_paired_ratios_and_reports_drift():
    results = _results()
    timed = _cell("timed", 1)
    k2 = next(r for r in results[1]["cells"] if r["cell"]["key"] == timed["key"])
    k2["paired_ratio"] = [1.2, 1.3, 1.25]  # the unpaired medians give 1.00x
    results[0]["drift"] = {timed["key"]: [{"group": 0, "tokens_per_s": [400.0]}, {"group": 1, "tokens_per_s": [500.0]}]}
    table = report.tabulate(results)
    row = next(r for r in table["rows"] if r["config"] == "vLLM K=2" and r["cell"]["key"] == timed["key"])
    assert row["speedup_vs_no_spec"] == pytest.approx(1.25) and row["interleaved"]
    md = report.markdown(table, {"summary": "t"}, "t")
    assert "Interleaved:" in md and "| code_heldout/b1/t0 | 400, 500 | 25.0% |" in md


def test_model_against_wall_clock_names_the_overhead():
    md = report.markdown(report.tabulate(_results()), {"summary": "t"}, "t")
    part = md.split("## Modeled speedup against the wall clock")[1]
    # t_T 2 ms, fixed spec-step cost 3 ms -> 0.50 t_T above a target step
    assert "c 4.00, speculative-step overhead above t_T 0.50 t_T" in part
    assert "| vLLM K=2 | 1.333 | 1.000x | +33.3% |" in part
    # + step cost: 2 prefills at t_T, 6 passes at 3 ms, 16 drafts at 0.5 ms: 32 ms of no speculation / 30 ms
    # per engine step: 16 steps of no speculation over 8 steps + 16 draft forwards / 4
    assert "| vLLM K=2 | 1.333 | 1.000x | +33.3% | 1.333 | 1.333 | 1.067 | +6.7% |" in part


def test_scaled_copies_may_part_only_at_a_bfloat16_tie(tmp_path):
    """check_same_tokens: a prompt whose output parts from the unscaled pair's passes only where the
    original's float32 top-2 margin is within two bfloat16 steps; any other parting stops the run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.harness.__main__ import check_same_tokens, tie_tolerance
    from benchmarks.paths import MODELS, load_prompts

    assert tie_tolerance(10.7) == 0.125 and tie_tolerance(-3.0) == 2.0**-5
    model = AutoModelForCausalLM.from_pretrained(MODELS / "toy-target", dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(MODELS / "toy-target")(load_prompts("code_heldout")[0]).input_ids
    with torch.no_grad():
        top2 = model(torch.tensor([ids])).logits[0, -1].topk(2)
    first, second = top2.indices.tolist()
    assert top2.values[0] - top2.values[1] > tie_tolerance(top2.values[0].item())  # a clear choice
    cell = _cell("timed", 1) | {"n_prompts": 1}

    def nospec(first_token: int) -> dict:
        row = {"cell": cell, "output_hashes": [str(first_token)], "_outputs": [[first_token, 5]]}
        return {"config": _cfg("no speculation", "nospec", "no speculation"), "cells": [row]}

    ref = tmp_path / "no_speculation.json"
    ref.write_text(json.dumps(nospec(first)))
    check_same_tokens([nospec(first)], ref, tmp_path)  # the same tokens
    assert json.loads((tmp_path / "same_tokens.json").read_text())["cells"] == {cell["key"]: True}
    with pytest.raises(SystemExit, match="other tokens"):
        check_same_tokens([nospec(second)], ref, tmp_path)
    parted = json.loads((tmp_path / "same_tokens.json").read_text())["parted"][cell["key"]]
    assert parted[0]["position"] == 0 and not parted[0]["tie"]
    assert parted[0]["margin"] == pytest.approx((top2.values[0] - top2.values[1]).item(), abs=1e-4)
    # a speculative row of the scaled run is held to the same reference
    spec = nospec(second) | {"config": _cfg("vLLM K=2", "vllm", "fixed K", 2)}
    with pytest.raises(SystemExit, match="other tokens"):
        check_same_tokens([nospec(first), spec], ref, tmp_path)
    record = json.loads((tmp_path / "same_tokens.json").read_text())
    assert record["parted"][cell["key"]] == [] and not record["rows"]["vLLM K=2"][cell["key"]][0]["tie"]


def test_timed_cells_show_the_oracles_gain_captured():
    """A timed cell's replay gives the oracle's S beside the rows, and the share of its gain over the best
    fixed K that the best adaptive row captures (the EAGLE-3 issue's second goal)."""
    results = _results()
    timed = _cell("timed", 1)
    # S at c = 4: confidence 1 / (7/16 + 12/16/4) = 1.6; oracle 1 / (6/16 + 10/16/4) = 1.882; K=2 1.333
    conf = _row(timed, 0.03, 7, n_draft=12, n_acc=9)
    results.insert(3, {"config": _cfg("confidence", "plugin", "confidence"), "cells": [conf]})
    results[-1]["replay"].append({"cell": timed, "k": 4, "oracle": True, "n_gen": 16, "n_target": 6, "n_draft": 10,
                                  "n_accepted": 10})  # fmt: skip
    md = report.markdown(report.tabulate(results), {"summary": "t"}, "t")
    part = md.split("## Modeled speedup against the wall clock")[1]
    assert "- oracle by S at measured c: 1.882 (cap K=4); confidence captures 49% of its gain over vLLM K=2" in part
    assert "- oracle by S (+ step cost):" in part and "- oracle by S at c = 4: 1.882" in part
    assert "regime: batch 1" in regime_plan().notes[0] and any(c.kind == "oracle" for c in regime_plan().configs)


def test_oracle_reads_interleaved_outputs_and_rebuilds_keep_the_measured_environment(tmp_path):
    from benchmarks.harness.__main__ import recorded_environment, save_timed_outputs

    (tmp_path / "raw").mkdir()
    timed, count = _cell("timed", 1), _cell("count", 8)
    rows = [{"cell": timed, "_prompt_ids": [[1, 2]], "_outputs": [[3]]}, {"cell": count, "_prompt_ids": None}]
    (tmp_path / "raw" / "no_speculation.json").write_text(json.dumps({"cells": rows}))
    (tmp_path / "nospec_outputs.json").write_text(json.dumps({count["key"]: {"prompt_ids": [[9]], "outputs": [[8]]}}))
    save_timed_outputs(tmp_path)
    saved = json.loads((tmp_path / "nospec_outputs.json").read_text())
    assert saved == {count["key"]: {"prompt_ids": [[9]], "outputs": [[8]]},
                     timed["key"]: {"prompt_ids": [[1, 2]], "outputs": [[3]]}}  # fmt: skip

    assert recorded_environment(tmp_path, kept=True)["summary"] != "Xeon run"  # nothing recorded yet
    (tmp_path / "report.json").write_text(json.dumps({"environment": {"summary": "Xeon run", "cpu": "Xeon"}}))
    env = recorded_environment(tmp_path, kept=True)
    assert env["cpu"] == "Xeon" and env["summary"].startswith("Xeon run (report rebuilt from raw/ on ")
    (tmp_path / "report.json").write_text(json.dumps({"environment": env}))
    again = recorded_environment(tmp_path, kept=True)  # a second rebuild still names the first run once
    assert again["summary"].count("Xeon run") == 1 and again["measured"] == "Xeon run"
    assert recorded_environment(tmp_path, kept=False)["summary"] != env["summary"]


def test_learned_rules_label_each_chain_up_to_its_first_disagreement():
    import torch

    from benchmarks.learned_rules import CAP, Chains

    runs = torch.tensor([0, 2, CAP])  # [C]: agreeing drafts per chain
    states, q = torch.randn(3, CAP, 4), torch.full((3, CAP), 0.5)
    chains = Chains(runs, states, q, torch.zeros(3, CAP), torch.tensor([[-0.1, 0.2]] * 3), side=0)
    mask, label = chains.labelled()
    assert mask.sum(1).tolist() == [1, 3, CAP] and label.sum(1).tolist() == [0, 2, CAP]
    assert not label[1, 2] and mask[1, 2] and not mask[1, 3]  # the first disagreement is the last example
    x = chains.inputs(state=True, q=True, target=True)
    assert x.shape == (3, CAP, 2 + 3 + 4)  # target's (log max, entropy), (log q_max, H, t), the state
    assert torch.equal(x[:, :, :2], torch.tensor([-0.1, 0.2]).expand(3, CAP, 2))


def test_only_matches_by_substring_or_exactly():
    from benchmarks.harness.__main__ import chosen

    assert chosen("pearl K=2 pre_draft=0", "pearl K=2") and not chosen("pearl K=2 pre_draft=0", "=pearl K=2")
    assert chosen("pearl K=2", "=pearl K=2")


def test_policy_cost_adds_head_rows_and_keeps_medians_of_repeats():
    from benchmarks import policy_cost

    plan = policy_cost.policies("eagle3", {"specdecpp-d3": "ablation.safetensors"})
    assert plan["specdecpp-d3"] == {"policy": "specdecpp", "head": "ablation.safetensors"}
    assert plan["specdecpp"]["head"].endswith("eagle3-specdecpp.safetensors")
    one = {"policy_share": 0.07, "policy_us_per_step": 100.0}
    assert policy_cost.summary([one]) == one
    runs = [
        one,
        {"policy_share": 0.05, "policy_us_per_step": 90.0},
        {"policy_share": 0.09, "policy_us_per_step": 130.0},
    ]
    row = policy_cost.summary(runs)
    assert (row["policy_share"], row["policy_us_per_step"], row["runs"]) == (0.07, 100.0, runs)


def test_another_eagle3_head_brings_the_files_made_for_it():
    """VLLM_ADAPTIVE_SPEC_BENCH_EAGLE3 swaps the EAGLE-3 head; the harness then reads the tuned thresholds
    made for that head (named after it) and none of the code head's trained heads (their fingerprint is
    the code head's: they would fail start-up on another head)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks.paths import EAGLE3_ENV, REPO

    code = (
        "import json; from benchmarks import paths; from benchmarks.harness import plan; "
        "print(json.dumps([str(paths.DRAFTERS['eagle3']), str(plan.EAGLE3_TUNED), "
        "[c.name for c in plan.eagle3_head_configs()]]))"
    )
    env = os.environ | {EAGLE3_ENV: "heads/toy/eagle3-mixed"}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, capture_output=True, text=True)
    head, tuned, names = json.loads(out.stdout)
    assert Path(head) == REPO / "heads" / "toy" / "eagle3-mixed"
    assert Path(tuned) == REPO / "heads" / "toy" / "eagle3-mixed.tune.json"
    recommended = json.loads(Path(tuned).read_text())["recommended"]
    assert f"confidence {recommended['confidence']['threshold']} (tuned on train, c=4)" in names
    assert not any("specdecpp" in n or "pacer" in n for n in names), names


def test_step_table_prices_each_length_a_row_verified(tmp_path):
    """Two fixed rows give R at m = 1 and m = 4; a row that kept 1 draft half its steps and 4 the other
    half costs its draft side plus those steps priced by R; a bent curve separates table and line."""
    from benchmarks.harness import step_table

    def row(name, family, hist, seconds, propose):
        cell = {"key": "timed/code_heldout/b1/t0", "timed": True, "batch": 1}
        return {
            "config": name, "family": family, "kind": "plugin", "cell": cell, "seconds": [seconds],
            "steps": sum(hist.values()), "draft_len_hist": {str(m): n for m, n in hist.items()},
            "policy_timing": {"propose_s": propose},
        }  # fmt: skip

    rows = [
        row("fixed 1", "plugin fixed", {1: 100}, 1.0 + 0.1, 0.1),  # R(1) = 10 ms
        row("fixed 4", "plugin fixed", {4: 100}, 1.6 + 0.4, 0.4),  # R(4) = 16 ms
        row("fixed 8", "plugin fixed", {8: 100}, 1.6 + 0.8, 0.8),  # R(8) = 16 ms: the curve bends
        row("mixed", "confidence", {1: 50, 4: 50}, 1.3 + 0.25, 0.25),
    ]
    pts = step_table.table_points(rows)
    assert [round(m) for m, _, _ in pts] == [1, 4, 8]
    by_table, by_line = step_table.predict(rows[3], pts)
    assert by_table == pytest.approx(0.25 + 50 * 0.010 + 50 * 0.016)
    assert abs(by_line - by_table) > 0.01  # the line through a bent curve misprices the mix
    text = "\n".join(step_table.step_table_section({"rows": rows}))
    assert "| mixed | 2.50 | 1.550 | 1.550 | +0.0% |" in text
    # a context tail row drafted 1 token a round and its context added 3 after it in half the rounds: its
    # passes verified 1 and 4 tokens, so it is priced by what each round sent (regression: priced by the
    # drafter's lengths alone, every pass at R(1))
    tail = row("tail", "copy tail", {1: 100}, 1.3 + 0.25, 0.25) | {"proposed_len_hist": {"1": 50, "4": 50}}
    assert step_table.predict(tail, pts)[0] == pytest.approx(0.25 + 50 * 0.010 + 50 * 0.016)
    assert step_table.step_split_section({"rows": rows}) == []  # no steady rounds on the clock: no split
    rows[3]["policy_timing"] |= {"steady_rounds": 90, "steady_gap_s": 0.9, "steady_target_s": 0.72, "gc_s": 0.01}
    split = "\n".join(step_table.step_split_section({"rows": rows}))
    # per pass 15.5 ms wall, 2.5 draft side; per steady round 10 ms gap, 8 of them the target's forward
    assert "| mixed | 2.50 | 15.50 | 2.50 | 13.00 | 10.00 | 8.00 | 2.00 | 0.100 |" in split

    # as a cost file: each forward at the draft side's slope over forwards (0.1 s / 100 steps per forward
    # per step = 1 ms), a pass over 1 + m tokens at the step less its forwards, 1 token at no speculation's
    for r, k in zip(rows[:3], (1, 4, 8)):
        r["draft_forwards_per_step"] = {str(k): 100}
    nospec = row("no speculation", "no speculation", {0: 200}, 1.6, 0.0) | {"kind": "nospec"}
    costs = step_table.batch1_costs([*rows, nospec])
    assert costs["draft_step_ms"] == [[1, pytest.approx(1.0)]]
    assert costs["verify_ms"] == [[1.0, pytest.approx(8.0)], [2, pytest.approx(10.0)], [5, 16.0], [9, 16.0]]
    # from counts alone: the fixed rows' draft side is 1 ms a forward and nothing a round, so the tail row
    # (100 steps, one forward each, passes over 1 and 4 tokens) costs 0.1 s of drafts plus its table price
    assert step_table.draft_fit(rows) == (pytest.approx(0.0, abs=1e-9), pytest.approx(0.001))
    tail["draft_forwards_per_step"] = {"1": 100}
    est = step_table.predict_from_counts(tail, pts, step_table.draft_fit(rows))
    assert est == pytest.approx(0.1 + 50 * 0.010 + 50 * 0.016)
    text = "\n".join(step_table.step_table_section({"rows": [*rows, tail, nospec]}))
    assert "| tail | 2.50 | 1.550 | 1.550 | +0.0% |" in text and "| 1.400 | -9.7% | 1.032 / 1.143 |" in text
    from vllm_adaptive_spec.policies.costs import load_costs

    path = tmp_path / "step_costs.json"
    path.write_text(json.dumps(costs))
    assert load_costs(str(path)) == costs


def test_the_report_says_what_s_misses_where_it_is_off_by_more_than_ten_percent():
    """Issue 19: where S at the measured c is off the wall clock by more than 10% at batch 1, the report
    prices the row from its counts on the cell's step table, or says that no table in the run can."""
    from benchmarks.harness import report

    cell = {"key": "timed/code_heldout/b1/t0", "timed": True, "batch": 1}

    def row(name, family, hist, seconds, propose, forwards, kind="plugin", s=None, wall=None):
        steps = sum(hist.values())
        return {
            "config": name, "family": family, "kind": kind, "cell": cell, "seconds": [seconds], "steps": steps,
            "draft_len_hist": {str(m): n for m, n in hist.items()}, "policy_timing": {"propose_s": propose},
            "draft_forwards_per_step": {str(forwards): steps}, "S_measured_c": s, "speedup_vs_no_spec": wall,
        }  # fmt: skip

    fixed = [  # R(1) = 10 ms, R(4) = R(8) = 16 ms; 1 ms a draft forward, nothing a round
        row("fixed 1", "plugin fixed", {1: 100}, 1.1, 0.1, 1, s=1.2, wall=1.15),
        row("fixed 4", "plugin fixed", {4: 100}, 2.0, 0.4, 4, s=1.0, wall=0.98),
        row("fixed 8", "plugin fixed", {8: 100}, 2.4, 0.8, 8, s=0.9, wall=0.88),
    ]
    nospec = row("no speculation", "no speculation", {0: 200}, 1.6, 0.0, 0, kind="nospec")
    # 100 rounds of one forward, passes over 1 and 4 tokens: 0.1 + 50 * 0.010 + 50 * 0.016 = 1.4 s from counts,
    # so 5% faster than its measured 1.47 s
    tail = row("tail", "copy tail", {1: 100}, 1.47, 0.25, 1, s=1.30, wall=1.10) | {
        "proposed_len_hist": {"1": 50, "4": 50}
    }
    vllm = row("vLLM K=4", "fixed K", {}, 1.0, 0.0, 0, kind="vllm", s=1.20, wall=1.00)
    here = [*fixed, tail, vllm]
    text = " ".join(report.model_misses(here, [*here, nospec]))
    assert "S is off by more than 10% on tail (+18.2%), vLLM K=4 (+20.0%)." in text
    assert "step table (each pass at the tokens it verified): tail +5.0%. What S misses" in text
    assert "vLLM K=4: no loop clock, so no step table prices it;" in text and "No step table in" not in text
    # without the fixed rows no table prices anything; within 10% nothing is said
    assert "No step table in this run prices it:" in " ".join(report.model_misses([tail], [tail, nospec]))
    assert report.model_misses(fixed, [*fixed, nospec]) == []


def test_a_block_drafters_cost_file_charges_one_forward_per_round(tmp_path):
    """DFlash drafts a round in one forward: the draft side per round is the plugin rows' loop time less
    their policy's (median), and a pass over 1 + m tokens a fixed row's step less that draft side, m the
    drafts it verified per step (vLLM's rows have no loop timer); write_costs takes this path for dflash."""
    from benchmarks.harness import step_table

    def row(name, family, kind, steps, seconds, n_draft=0, timing=None):
        cell = {"key": "timed/code_heldout/b1/t0", "timed": True, "batch": 1}
        return {
            "config": name, "family": family, "kind": kind, "cell": cell, "seconds": [seconds], "steps": steps,
            "n_draft": n_draft, "method": "dflash", "policy_timing": timing,
        }  # fmt: skip

    rows = [
        row("no speculation", "no speculation", "nospec", 200, 1.6),  # 8 ms a pass over 1 token
        row("vLLM K=2", "fixed K", "vllm", 100, 2.0, 195),  # 20 ms a step, 1.95 verified
        row("vLLM K=3", "fixed K", "vllm", 100, 2.2, 290),  # 22 ms, 2.9 verified
        row("confidence", "confidence", "plugin", 100, 2.1, 240, {"propose_s": 0.4, "policy_s": 0.05, "rounds": 100}),
        row("fixed 3", "plugin fixed", "plugin", 100, 2.2, 300, {"propose_s": 0.36, "policy_s": 0.01, "rounds": 100}),
    ]  # fmt: skip
    costs = step_table.block_costs(rows)
    assert costs["draft_step_ms"] == [[1, pytest.approx(3.5)]]
    assert costs["verify_ms"] == [
        [1.0, pytest.approx(8.0)], [2.95, pytest.approx(16.5)], [3.9, pytest.approx(18.5)], [4.0, pytest.approx(18.5)]
    ]  # fmt: skip
    assert step_table.block_costs(rows[:3]) is None  # no plugin row: no draft side per round
    written = step_table.write_costs({"rows": rows}, tmp_path)
    assert [p.name for p in written] == ["step_costs_code_heldout.json"]
    assert json.loads(written[0].read_text()) == json.loads(json.dumps(costs))


def test_dflash_regime_rows_run_in_the_block_with_its_tuned_thresholds():
    """--regime --drafter dflash: the step-table rows draft k of each block of 8 (k past it goes), the
    policies' cap is the block, and the thresholds `tune` chose for the drafter join as timed rows."""
    import argparse

    from benchmarks.harness.__main__ import use_drafter
    from benchmarks.harness.plan import regime_plan
    from benchmarks.paths import DFLASH_HEAD

    plan = regime_plan()
    use_drafter(argparse.Namespace(drafter="dflash", regime=True, batched=False), plan)
    by_name = {c.name: c for c in plan.configs}
    assert by_name["plugin fixed K=3 in a block of 8"].adaptive == {"policy": "fixed", "k": 3}
    assert by_name["plugin fixed K=3 in a block of 8"].k == 8
    assert not any("cap 16" in n or "K=12" in n for n in by_name), sorted(by_name)
    tuned = json.loads((DFLASH_HEAD.parent / f"{DFLASH_HEAD.name}.tune-costs.json").read_text())["recommended"]
    row = by_name[f"confidence {tuned['confidence']['threshold']} (tuned on train, costs)"]
    assert row.timed and row.k == 8 and row.method == "dflash" and row.adaptive["batch_aware"] is False


def test_fresh_engines_merge_one_repeat_per_engine_life():
    from benchmarks.harness.interleaved import merge_lives

    def life(seconds, ratio, policy_s):
        cell = {"key": "timed/code_heldout/b1/t0", "repeats": 1}
        return {
            "cell": cell, "seconds": [seconds], "tokens_per_s": [64 / seconds], "paired_ratio": [ratio],
            "n_target": 30, "policy_timing": {"policy_s": policy_s, "propose_s": 1.0},
        }  # fmt: skip

    row = merge_lives([life(2.0, 1.5, 0.1), life(4.0, 1.7, 0.3)])
    assert row["seconds"] == [2.0, 4.0] and row["tokens_per_s"] == [32.0, 16.0] and row["paired_ratio"] == [1.5, 1.7]
    assert row["cell"]["repeats"] == 2 and row["engine_lives"] == 2 and row["n_target"] == 30
    assert row["policy_timing"] == {"policy_s": pytest.approx(0.2), "propose_s": 1.0}


def test_rescore_prices_the_counts_of_record_at_a_timed_runs_c_and_f():
    """Counts of one report at another run's measured batch-1 c, each adaptive row charged the f measured
    for the same configuration there; rows the timed run did not time are left out, not charged."""
    from benchmarks.harness.rescore import rescore

    count = _cell("count", 8)  # the count cell of _results()
    counts = report.tabulate(
        [
            *_results()[:3],
            {"config": _cfg("conf", "plugin", "confidence"),
             "cells": [_row(count, 0.1, 6, n_draft=12, n_acc=10)]},
            {"config": _cfg("untimed", "plugin", "svip"), "cells": [_row(count, 0.1, 6, n_draft=12, n_acc=10)]},
            {"config": _cfg("oracle", "oracle", "oracle"),
             "replay": [{"cell": count, "k": 16, "oracle": True, "n_gen": 16, "n_target": 4, "n_draft": 12,
                         "n_accepted": 12}]},
        ]
    )  # fmt: skip
    timed = {
        "cost_ratios": {"timed/code_heldout/b1/t0": {"c": 2.0}},
        "rows": [{"config": "conf", "cell": _cell("timed", 1), "kind": "plugin",
                  "policy_cost_frac_of_draft_step": 0.5}],
    }  # fmt: skip
    (cell,) = rescore(counts, timed).values()
    assert cell["c"] == 2.0
    rows = {r["config"]: r for r in cell["rows"]}
    assert "untimed" not in rows
    # vLLM K=2 on the count cell: 1 / (8/16 + 16/16 / 2) = 1.0; K=4: 1 / (0.5 + 2 / 2) = 0.667
    at_c = cell["S_measured_c"]
    assert at_c["best_fixed_K"] == pytest.approx(1.0)
    # conf: N_T 6 of 16 tokens, 12 drafts at f = 0.5: 1 / (6/16 + (12/16) (1 + 0.5) / 2)
    conf = rows["conf"]["S_measured_c"]
    assert conf["S"] == pytest.approx(1 / (6 / 16 + 12 / 16 * 1.5 / 2))
    assert at_c["oracle"] == pytest.approx(1 / (4 / 16 + 12 / 16 / 2))
    assert conf["oracle_gain_share"] == pytest.approx((conf["S"] - 1.0) / (at_c["oracle"] - 1.0))
    # at c = 4 the same f: the timed run's, not the count cell's own
    assert rows["conf"]["S_c4"]["S"] == pytest.approx(1 / (6 / 16 + 12 / 16 * 1.5 / 4))
    assert any("captures" in line and "measured c" in line for line in cell["lines"])
