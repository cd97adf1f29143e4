"""What the harness runs: configurations, workloads and the cells they run on.

A *configuration* is one speculation setup (its own process, its own engine).
A *cell* is one slice of work: a prompt family, a batch size, a temperature,
how many prompts and tokens, how many timed repeats. Two kinds of cells:
- timed cells (every batch size, greedy and sampled) give wall-clock
  tokens/s, medians over repeats; only the headline configurations run them;
- count cells (greedy, large batch, one pass over more prompts) give the
  hardware-independent counts (tau, discard and verification rate) for every
  configuration, threshold sweeps included, and the lossless check.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.paths import EAGLE3_HEAD, REPO, beside, load_prompts

WORKLOADS = ("code_heldout", "prose_heldout")
FIXED_KS = (1, 2, 3, 4, 6, 8, 12, 16)
CAP = 16  # cap K of every adaptive policy
TAILS = (4, 8, 15)  # the regime's context-tail rows (within the cap 16)
TAIL_FLOORS = ((4, 2), (4, 3), (4, 4), (2, 2))  # (context_tail, min_drafts) of the regime's head rows with both
CAPPED_TAILS = ((4, 0, 4), (4, 2, 4), (4, 3, 4), (4, 2, 5))  # (context_tail, min_drafts, cap K) under a low cap
NGRAM_KS = (4, 8, 16)  # vLLM's prompt lookup (method "ngram", n-grams of 2-4 tokens: benchmarks.vllm_run)
VERIFY_CURVE_KS = (1, 2, 3, 4, 6, 8, 12)  # the regime's "plugin fixed K=k under cap 16" rows
# vLLM's Dynamic SD: (first batch size, last batch size, K); K shrinks as the batch grows.
DYNAMIC_SCHEDULE = [[1, 1, 3], [2, 4, 3], [5, 16, 2], [17, 64, 1]]
SPECDECPP_HEAD = REPO / "heads" / "toy" / "specdecpp.safetensors"
PACER_HEAD = REPO / "heads" / "toy" / "pacer.safetensors"
# Files made for the EAGLE-3 head the harness runs (benchmarks.paths.EAGLE3_HEAD), beside it and named after it.
EAGLE3_SPECDECPP_HEAD = beside(EAGLE3_HEAD, "-specdecpp.safetensors")  # trained on the EAGLE-3 head
EAGLE3_PACER_HEAD = beside(EAGLE3_HEAD, "-pacer.safetensors")  # trained on the EAGLE-3 head
# svip and confidence thresholds for the EAGLE-3 head, chosen on training responses (`vllm-adaptive-spec tune`):
# at c = 4 (the counts of record), c = 12 (near regime (c)'s measured 11-13.5) and c = 17 (an H100 at 8B sizes)
EAGLE3_TUNED = beside(EAGLE3_HEAD, ".tune.json")
EAGLE3_TUNED_FILES = (EAGLE3_TUNED, *(beside(EAGLE3_HEAD, f".tune-c{c}.json") for c in (12, 17)))
# The position-embedding ablation: two layers trained alike (500 responses), with and without e_i.
PACER_ABLATION_PAIR = {
    "on": REPO / "heads" / "toy" / "ablations" / "pacer_pos500.safetensors",
    "off": REPO / "heads" / "toy" / "ablations" / "pacer_nopos500.safetensors",
}


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # nospec | vllm | plugin | hf | oracle
    family: str  # plot series: "fixed K", "svip", ...
    k: int = 0  # cap K (vllm, plugin); HF's initial K
    adaptive: dict | None = None  # adaptive_spec value (plugin)
    dynamic: list | None = None  # vLLM num_speculative_tokens_per_batch_size
    hf: dict | None = None  # {"mode": "heuristic"|"confidence", "value": ...}
    sweep: float | None = None  # the swept value, for plots
    timed: bool = False  # runs the timed cells too
    workloads: tuple[str, ...] | None = None  # only these prompt families (None: all)
    method: str = "draft_model"  # speculative_config.method: the bundled drafter (benchmarks.paths.DRAFTERS)
    env: dict | None = None  # environment of the engine's processes (e.g. LD_PRELOAD; benchmarks/preload.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Cell:
    workload: str
    batch: int
    temperature: float
    n_prompts: int
    max_tokens: int
    repeats: int
    timed: bool

    @property
    def key(self) -> str:
        kind = "timed" if self.timed else "count"
        return f"{kind}/{self.workload}/b{self.batch}/t{self.temperature:g}"


@dataclass
class Plan:
    configs: list[Config]
    cells: list[Cell]
    oracle_ks: tuple[int, ...] = tuple(range(1, 17))
    notes: list[str] = field(default_factory=list)

    def cells_for(self, config: Config) -> list[Cell]:
        if config.kind == "hf":  # batch 1, greedy: what HF assisted generation supports
            return [c for c in self.cells if c.batch == 1 and c.temperature == 0.0 and c.timed]
        if is_pearl(config):  # one request at a time
            return [c for c in self.cells if c.batch == 1 and (config.timed or not c.timed)]
        cells = [c for c in self.cells if config.timed or not c.timed]
        return [c for c in cells if config.workloads is None or c.workload in config.workloads]


def is_pearl(config: Config) -> bool:
    return (config.adaptive or {}).get("policy") == "pearl"


def pearl_configs() -> list[Config]:
    """PEARL's parallel mode at caps 2, 3, 4 and 8 (the draft drafts until the target needs its tokens,
    at most K + 1, while the target verifies at most K)."""
    return [
        Config(f"pearl K={k}", "plugin", "pearl", k, {"policy": "pearl"}, sweep=k, timed=True) for k in (2, 3, 4, 8)
    ]


def _plugin(name: str, family: str, adaptive: dict, sweep: float | None = None, timed: bool = False) -> Config:
    # A threshold sweep (count cells only) measures the per-request stopping rule itself, so it runs
    # with the batch gate off; each family's default (timed) keeps the gate on, its ablation turns it off.
    if not timed:
        adaptive = adaptive | {"batch_aware": False}
    return Config(name, "plugin", family, CAP, adaptive, sweep=sweep, timed=timed)


def _policy_sweeps(head_exists: bool) -> list[Config]:
    # The first of each family is its default setting (timed); the rest sweep its threshold.
    configs = [
        _plugin("svip h=0.3 (default)", "svip", {"policy": "svip"}, 0.3, timed=True),
        *[_plugin(f"svip h={h}", "svip", {"policy": "svip", "threshold": h}, h) for h in (0.5, 0.7, 0.8, 0.9, 1.1)],
        _plugin("adaedl (default)", "adaedl", {"policy": "adaedl"}, 0.9, timed=True),
        *[
            _plugin(
                f"adaedl lam=0 g={g} a=0.1", "adaedl", {"policy": "adaedl", "lam": 0.0, "gamma": g, "target_ar": 0.1}, g
            )
            for g in (0.12, 0.15, 0.18, 0.22)
        ],
        _plugin("confidence 0.4 (default)", "confidence", {"policy": "confidence"}, 0.4, timed=True),
        *[
            _plugin(f"confidence {t}", "confidence", {"policy": "confidence", "threshold": t}, t)
            for t in (0.1, 0.2, 0.3, 0.5, 0.6)
        ],
        _plugin("heuristic (default)", "heuristic", {"policy": "heuristic"}, 4, timed=True),
        # drafting goes on while the draft repeats its context or is confident (policies/copy.py)
        _plugin("copy 0.7 (default)", "copy", {"policy": "copy"}, 0.7, timed=True),
        *[_plugin(f"copy {t}", "copy", {"policy": "copy", "threshold": t}, t) for t in (0.0, 0.3, 0.5, 0.9, 1.0)],
        # the batch gate's ablation: the same defaults with adaptive_spec.batch_aware off
        *[
            _plugin(f"{p} (no batch gate)", f"{p} no gate", {"policy": p, "batch_aware": False}, timed=True)
            for p in ("svip", "confidence", "copy")
        ],
        _plugin("plugin fixed K=16", "plugin fixed", {"policy": "fixed"}, 16),
        # the plugin's loop with vLLM's rule: its overhead over vLLM's own loop, side by side with vLLM K=4
        Config("plugin fixed K=4", "plugin", "plugin fixed", 4, {"policy": "fixed"}, sweep=4, timed=True),
        # the batch gate alone decides (cap 16): its expected-tokens-per-cost rule at the cell's costs
        _plugin("batch gate alone", "gate", {"policy": "fixed", "batch_aware": True}, timed=True),
    ]
    if head_exists:
        head = str(SPECDECPP_HEAD)
        configs.append(
            _plugin("specdecpp th=0.8 (head default)", "specdecpp", {"policy": "specdecpp", "head": head}, timed=True)
        )
        configs += [
            _plugin(f"specdecpp th={t}", "specdecpp", {"policy": "specdecpp", "head": head, "threshold": t}, t)
            for t in (0.3, 0.5, 0.65, 0.9, 0.95)
        ]
    if PACER_HEAD.exists():
        head = str(PACER_HEAD)
        configs.append(_plugin("pacer (layer defaults)", "pacer", {"policy": "pacer", "head": head}, timed=True))
        configs += [
            _plugin(f"pacer t={t}", "pacer", {"policy": "pacer", "head": head, "threshold": t}, t)
            for t in (0.4, 0.5, 0.6, 0.8, 0.9, 0.95)
        ]
    return configs


def eagle3_head_configs(regime: bool = False) -> list[Config]:
    """Stopping heads trained on the bundled EAGLE-3 head (the draft model's do not load on it), and
    svip / confidence at the thresholds `tune` chose for it on training responses (gate off, as sweeps).
    regime: the batch-1 regime's rows, all timed: each head with and without the gate, the tuned rows."""
    configs = []
    if EAGLE3_SPECDECPP_HEAD.exists():
        head = str(EAGLE3_SPECDECPP_HEAD)
        configs += [
            _plugin("specdecpp (eagle3 head default)", "specdecpp", {"policy": "specdecpp", "head": head}, timed=True),
            _plugin("specdecpp eagle3 (no batch gate)", "specdecpp", {"policy": "specdecpp", "head": head}),
            *[
                _plugin(
                    f"specdecpp eagle3 th={t}", "specdecpp", {"policy": "specdecpp", "head": head, "threshold": t}, t
                )
                for t in (0.3, 0.9)  # either side of the bundled head's 0.5
            ],
        ]
    if EAGLE3_PACER_HEAD.exists():
        head = str(EAGLE3_PACER_HEAD)
        configs += [
            _plugin("pacer (eagle3 layer defaults)", "pacer", {"policy": "pacer", "head": head}, timed=True),
            _plugin("pacer eagle3 (no batch gate)", "pacer", {"policy": "pacer", "head": head, "batch_aware": False}),
        ]
    for path in EAGLE3_TUNED_FILES:
        for alone in tuned_configs(path):
            configs.append(alone)
            if regime:  # the same rule with the batch gate on, deciding on the regime's costs (--costs)
                gated = alone.name.replace(" (tuned", " gated (tuned")
                rule = {k: v for k, v in alone.adaptive.items() if k != "batch_aware"}  # the gate at its default
                configs.append(replace(alone, name=gated, adaptive=rule, timed=True))
                # ... and the rule alone under a cap of 8, which it rarely reaches: what the cap costs
                configs.append(replace(alone, name=f"{alone.name}, cap 8", k=8))
                # ... and the rule alone above a floor of drafts (adaptive_spec.min_drafts): a head's draft
                # step is cheap, so a floor near the best fixed K costs little and keeps the rule's long drafts
                configs += [
                    replace(alone, name=f"{alone.name}, min {n} drafts", adaptive=alone.adaptive | {"min_drafts": n})
                    for n in (2, 4)
                ]
                # ... and with a context tail (adaptive_spec.context_tail): the head drafts, the context adds
                configs += [
                    replace(
                        alone, name=f"{alone.name}, context tail {m}", adaptive=alone.adaptive | {"context_tail": m}
                    )
                    for m in TAILS
                ]
                # ... and a tail above a floor of drafts: on this CPU a pass over 2 tokens cost more than one
                # over 3-5 (the step table, README "The step table"), and a third of the tail row's rounds
                # sent one draft and no tail; a tail of 2 over a floor of 2 keeps passes on that flat stretch
                configs += [
                    replace(
                        alone,
                        name=f"{alone.name}, context tail {m}, min {n} drafts",
                        adaptive=alone.adaptive | {"context_tail": m, "min_drafts": n},
                    )
                    for m, n in TAIL_FLOORS
                ]
                # ... and the same under the best fixed K's cap (K=4 here): on this CPU a pass costs about the
                # same over 2-5 tokens and more from 6 (the step table: 1.03 t_T at 3.7 drafts, 1.19 at 5.5);
                # under the cap every pass stays on that flat stretch, the tail filling what the rule leaves.
                # Measured on training prompts (tail_cap_train_epyc12/): no better than cap 16, worse at 4
                configs += [
                    replace(
                        alone,
                        name=f"{alone.name}, context tail {m}" + (f", min {n} drafts" if n else "") + f", cap {k}",
                        k=k,
                        adaptive=alone.adaptive | {"context_tail": m} | ({"min_drafts": n} if n else {}),
                    )
                    for m, n, k in CAPPED_TAILS
                ]
                # ... and the gated rule with a short tail: the batched plan's row (the gate ends rounds
                # for the whole batch; a tail adds no draft forward), with the tail gate (adaptive_spec.tail_gate,
                # the default until 2026-12-06: these rows keep the names they were reported under)
                tail = rule | {"context_tail": 4, "tail_gate": True}
                configs.append(replace(alone, name=f"{gated}, context tail 4", adaptive=tail))
                # ... without the tail gate (the plugin's default)
                configs.append(
                    replace(
                        alone,
                        name=f"{gated}, context tail 4, no tail gate",
                        adaptive=rule | {"context_tail": 4, "tail_gate": False},
                    )
                )
                # ... and both gates on the costs the loop measures as it runs (a regime the bundled curves,
                # the toy pair's, do not describe)
                configs.append(
                    replace(
                        alone,
                        name=f"{gated}, context tail 4, online costs",
                        adaptive=tail | {"costs": "online"},
                    )
                )
    if regime:
        configs = [replace(c, timed=True) for c in configs if c.sweep is None or "tuned on train" in c.name]
    return configs


def tuned_configs(path: Path) -> list[Config]:
    """svip and confidence at the thresholds a `vllm-adaptive-spec tune` report recommends (none without the
    file), batch gate off (as sweeps): "<policy> <t> (tuned on train, c=<c>)", or "..., costs)" where the
    report chose on a cost file's curves."""
    if not path.exists():
        return []
    tuned = json.loads(path.read_text())
    on = "costs" if tuned["config"].get("costs") else f"c={tuned['config']['cost_ratio']:g}"
    return [
        _plugin(f"{policy} {t} (tuned on train, {on})", policy, {"policy": policy, "threshold": t}, t)
        for policy, t in ((p, v["threshold"]) for p, v in tuned["recommended"].items())
    ]


def _eagle3_tuned() -> dict[str, dict]:
    """policy -> its recommended setting for the bundled EAGLE-3 head ({} without the file)."""
    return json.loads(EAGLE3_TUNED.read_text())["recommended"] if EAGLE3_TUNED.exists() else {}


def _pacer_ablations() -> list[Config]:
    """Pacer's ablations (paper tables 5, 7, 8) through vLLM: count cells on code prompts only.
    Each changes one setting of the bundled layer's recommended ones (from its file: block 2,
    threshold 0.7, growth 1.0, mean halting, window 64); the position pair swaps in two layers
    trained alike on 500 responses, both run at block 2, threshold 0.5, growth 1.0. The batch gate is
    off (the ablations measure the layer's rule; at batch 32 the gate would end every round first)."""
    if not PACER_HEAD.exists():
        return []
    head = str(PACER_HEAD)
    variants = [
        ("none (layer defaults)", {}, None),  # the reference the others change one setting of
        *[(f"block={b}", {"block_size": b}, b) for b in (1, 3, 4, 5, 6, 7)],
        ("halting=any", {"halting": "any"}, None),
        ("halting=last", {"halting": "last"}, None),
        ("growth=1.05", {"growth": 1.05}, 1.05),
        ("context=full", {"context_window": 1_000_000}, None),
        ("context=drafts only", {"context_window": 0}, None),
    ]
    configs = [
        Config(
            f"pacer ablation {label}",
            "plugin",
            "pacer ablation",
            CAP,
            {"policy": "pacer", "head": head, "batch_aware": False, **extra},
            sweep=sweep,
            workloads=("code_heldout",),
        )
        for label, extra, sweep in variants
    ]
    if all(p.exists() for p in PACER_ABLATION_PAIR.values()):
        settings = {"block_size": 2, "threshold": 0.5, "growth": 1.0}
        configs += [
            Config(
                f"pacer ablation position={k}",
                "plugin",
                "pacer ablation",
                CAP,
                {"policy": "pacer", "head": str(p), "batch_aware": False, **settings},
                workloads=("code_heldout",),
            )
            for k, p in PACER_ABLATION_PAIR.items()
        ]
    return configs


def full_plan() -> Plan:
    configs = [
        Config("no speculation", "nospec", "no speculation", timed=True),
        *[Config(f"vLLM K={k}", "vllm", "fixed K", k, sweep=k, timed=True) for k in FIXED_KS],
        Config(
            "vLLM dynamic SD",
            "vllm",
            "vLLM dynamic",
            max(r[2] for r in DYNAMIC_SCHEDULE),
            dynamic=DYNAMIC_SCHEDULE,
            timed=True,
        ),
        # vLLM's prompt lookup (method "ngram": drafts copied from the request's context, no draft model)
        *[
            Config(f"vLLM ngram K={k}", "vllm", "vLLM ngram", k, sweep=k, timed=k in (8, 16), method="ngram")
            for k in NGRAM_KS
        ],
        # vLLM's adaptive verification (our implementation): drafts the full K, verifies the best slots
        *[
            Config(f"vllm_av K={k}", "plugin", "vllm_av", k, {"policy": "vllm_av"}, sweep=k, timed=k == 4)
            for k in (4, 8)
        ],
        *_policy_sweeps(SPECDECPP_HEAD.exists()),
        *_pacer_ablations(),
        *[c for c in pearl_configs() if c.k == 2],  # batch-1 cells only (one request at a time)
        Config("HF heuristic (K0=5)", "hf", "HF assisted", 5, hf={"mode": "heuristic", "value": 5}),
        Config("HF confidence 0.4", "hf", "HF assisted", 20, hf={"mode": "confidence", "value": 0.4}),
        Config("oracle", "oracle", "oracle"),
    ]
    cells = []
    for w in WORKLOADS:
        cells.append(Cell(w, 32, 0.0, 100, 128, 1, timed=False))
        for b in (1, 4, 16, 32):
            cells.append(Cell(w, b, 0.0, 16 if b == 1 else 32, 64, 3, timed=True))
        for b in (1, 16):
            cells.append(Cell(w, b, 1.0, 16 if b == 1 else 32, 64, 3, timed=True))
    return Plan(configs, cells)


def short_plan() -> Plan:
    """A few minutes: the headline configurations on code prompts, on the draft model and the EAGLE-3 head."""
    names = {
        "no speculation",
        "vLLM K=2",
        "vLLM K=4",
        "pearl K=2",
        "svip h=0.8",
        "confidence 0.4 (default)",
        "specdecpp th=0.8 (head default)",
        "pacer (layer defaults)",
        "oracle",
    }
    full = full_plan()
    configs = [c for c in full.configs if c.name in names]
    configs = [Config(**(c.to_dict() | {"timed": c.kind != "oracle"})) for c in configs]
    # the bundled EAGLE-3 head: vLLM's K=4 and the head's best policy, confidence at the threshold
    # `tune` chose for it on training responses (its best in the eagle3 counts of record)
    threshold = _eagle3_tuned().get("confidence", {}).get("threshold", 0.4)
    configs += [
        Config("EAGLE-3 vLLM K=4", "vllm", "eagle3 fixed K", 4, sweep=4, timed=True, method="eagle3"),
        Config(
            f"EAGLE-3 confidence {threshold}",
            "plugin",
            "eagle3 confidence",
            CAP,
            {"policy": "confidence", "threshold": threshold},
            sweep=threshold,
            timed=True,
            method="eagle3",
        ),
    ]
    cells = [
        Cell("code_heldout", 16, 0.0, 48, 96, 1, timed=False),
        Cell("code_heldout", 1, 0.0, 8, 96, 2, timed=True),
        Cell("code_heldout", 16, 0.0, 32, 96, 2, timed=True),
    ]
    return Plan(configs, cells, oracle_ks=(1, 2, 3, 4, 6, 8, 12, 16))


def batch_plan(steady: bool = False) -> Plan:
    """Batched serving (issue: batch-aware drafting): fixed K, vLLM's dynamic SD, vllm_av and the
    policies with and without the batch gate, timed side by side at batch 4, 16 and 32, greedy
    (each timed cell also counts exactly). A cell serves its prompts at concurrency b: 32 prompts, so
    at batch 16 and 32 most steps are the first wave's and the drain's; `steady` serves about 8 per
    slot (at most the family's held-out prompts), as a busy endpoint runs."""
    names = {
        "no speculation",
        *(f"vLLM K={k}" for k in (1, 2, 3, 4)),
        "vLLM dynamic SD",
        "vllm_av K=4",
        "svip h=0.3 (default)",
        "svip (no batch gate)",
        "confidence 0.4 (default)",
        "confidence (no batch gate)",
        "specdecpp th=0.8 (head default)",
        "batch gate alone",
        "copy 0.7 (default)",
        "copy (no batch gate)",
    }
    full = full_plan()
    configs = [Config(**(c.to_dict() | {"timed": True})) for c in full.configs if c.name in names]
    # the plugin's loop at vLLM K=1's and K=2's settings: what the loop itself costs beside vLLM's own
    configs += [
        Config(f"plugin fixed K={k}", "plugin", "plugin fixed", k, {"policy": "fixed"}, sweep=k, timed=True)
        for k in (1, 2)
    ]
    # the gate on the costs it measures as it runs (adaptive_spec.costs "online"), beside the same rows
    # on a cost file (--costs) or the bundled curves
    online = {"costs": "online"}
    configs += [
        _plugin("confidence 0.4 (online costs)", "confidence online", {"policy": "confidence"} | online, 0.4, True),
        _plugin(
            "batch gate alone (online costs)",
            "gate online",
            {"policy": "fixed", "batch_aware": True} | online,
            None,
            True,
        ),
    ]
    # vLLM's prompt lookup, and the context tail on copy (README, "The context tail")
    configs += [Config(**(c.to_dict() | {"timed": True})) for c in full.configs if c.name == "vLLM ngram K=4"]
    # (with the tail gate, the default until 2026-12-06: the rows keep the names they were reported under)
    cut = {"policy": "copy", "context_tail": 4, "tail_gate": True}
    configs.append(_plugin("copy 0.7, context tail 4", "copy tail", cut, 4, True))
    no_cut = {"policy": "copy", "context_tail": 4, "tail_gate": False}  # the plugin's default
    configs.append(_plugin("copy 0.7, context tail 4, no tail gate", "copy tail no gate", no_cut, 4, True))
    # ... as before 2026-12-07: a round the gate verifies no draft in still runs the draft's first pass
    # and verifies the tails (adaptive_spec.skip_first_pass false)
    configs.append(
        _plugin(
            "copy 0.7, context tail 4, no tail gate, first pass every round",
            "copy tail no gate no skip",
            no_cut | {"skip_first_pass": False},
            4,
            True,
        )
    )
    configs.append(_plugin("copy 0.7, context tail 4, online costs", "copy tail online", cut | online, 4, True))
    # ... the default on measured costs (regime (b), batch 32: the same decisions as on the bundled curves)
    configs.append(
        _plugin(
            "copy 0.7, context tail 4, no tail gate, online costs", "copy tail no gate online", no_cut | online, 4, True
        )
    )
    cells = [c for c in full.cells if c.temperature == 0.0 and c.timed and c.batch > 1]
    notes = ["batched: greedy, batch 4/16/32, timed cells only; counts are the cells' own"]
    if steady:  # a busy endpoint: about 8 requests per slot, so most steps run a full batch
        held_out = {w: len(load_prompts(w)) for w in {c.workload for c in cells}}
        cells = [replace(c, n_prompts=min(held_out[c.workload], max(c.n_prompts, 8 * c.batch))) for c in cells]
        sizes = sorted({(c.batch, c.n_prompts) for c in cells})
        notes.append(f"steady: {', '.join(f'{n} prompts at batch {b}' for b, n in sizes)}")
    return Plan(configs, cells, notes=notes)


def regime_plan() -> Plan:
    """Batch-1 wall clock on cost-scaled copies (--target-mlp-factor / --draft-mlp-factor): fixed K,
    vLLM's dynamic SD and every policy at its default, interleaved. The cells are the full plan's
    timed greedy batch-1 cells, so the scaled run's tokens can be checked against the unscaled run's."""
    names = {
        "no speculation",
        *(f"vLLM K={k}" for k in (1, 2, 3, 4, 6, 8)),  # K=8: a head regime (c near 10) may want long drafts
        "vLLM dynamic SD",
        "vllm_av K=8",  # vLLM's adaptive verification (ours): what a DFlash block's cut competes with
        # prompt lookup: the toy target's outputs repeat their context (README, "The context tail")
        "vLLM ngram K=8",
        "vLLM ngram K=16",
        "svip h=0.3 (default)",
        "adaedl (default)",
        "confidence 0.4 (default)",
        "heuristic (default)",
        "specdecpp th=0.8 (head default)",
        "pacer (layer defaults)",
        "plugin fixed K=4",
        "plugin fixed K=16",  # long verify passes: what the step-cost model charges them
        "batch gate alone",
        # the rules alone: their batch-1 cost without the gate's per-round work
        "svip (no batch gate)",
        "confidence (no batch gate)",
        "copy 0.7 (default)",
        "copy (no batch gate)",
        "oracle",  # replays the timed cells' no-speculation outputs after they ran (counts only)
    }
    full = full_plan()
    configs = [Config(**(c.to_dict() | {"timed": True})) for c in full.configs if c.name in names]
    # the loop in the order it takes on CUDA (adaptive_spec.prepare_ahead): what that order costs on a CPU
    svip = next(c for c in configs if c.name == "svip h=0.3 (default)")
    ahead = svip.adaptive | {"prepare_ahead": True}
    configs.append(replace(svip, name="svip h=0.3, prepared ahead", family="svip prepared ahead", adaptive=ahead))
    # the cap's own cost at equal work: the plugin's fixed K=4 in an engine whose cap is the policies' 16
    fixed4 = next(c for c in configs if c.name == "plugin fixed K=4")
    # ... and at other lengths: a batch-1 pass's cost per verified token count, at the cap the policies run
    # under (what an adaptive row's mix of lengths costs on this machine's kernels; report: step table)
    configs += [
        replace(fixed4, name=f"plugin fixed K={k} under cap 16", sweep=k, k=CAP, adaptive={"policy": "fixed", "k": k})
        for k in VERIFY_CURVE_KS
    ]
    # a second engine of the same configuration: the spread between two engines that no repeat removes
    configs.append(Config("vLLM K=4 (twin engine)", "vllm", "engine twin", 4, sweep=4, timed=True))
    # the gate on the regime's own costs (the bundled curves are the unscaled toy pair's, a lower c);
    # measured on regime (b): no better than the bundled curves (README, "The copy rule in regime (b)")
    copy_online = {"policy": "copy", "costs": "online"}
    configs.append(_plugin("copy 0.7 (online costs)", "copy online", copy_online, 0.7, timed=True))
    # a floor of two drafts (adaptive_spec.min_drafts): on this CPU a target pass over 2 tokens cost more
    # than one over 3 (README, "Where a step goes"), so a row's second draft costs its draft forward only
    configs += [
        _plugin(f"{name}, min 2 drafts", f"{family} min 2", {"policy": family, "min_drafts": 2}, th, timed=True)
        for name, family, th in (("copy 0.7", "copy", 0.7), ("confidence 0.4", "confidence", 0.4))
    ]
    # the context tail (adaptive_spec.context_tail): after the drafts, up to m tokens the context predicts
    configs += [
        _plugin(f"copy 0.7, context tail {m}", "copy tail", {"policy": "copy", "context_tail": m}, m, timed=True)
        for m in TAILS
    ]
    cells = [c for c in full.cells if c.timed and c.batch == 1 and c.temperature == 0.0]
    notes = ["regime: batch 1, greedy, timed cells only; counts are the cells' own"]
    return Plan(configs, cells, oracle_ks=(1, 2, 3, 4, 6, 8, 12, 16), notes=notes)


def pearl_plan() -> Plan:
    """PEARL against sequential speculation at batch 1, greedy, side by side: fixed K 1-4 and the best
    adaptive policies on the engine's default cores (vLLM binds the engine to one core and keeps the
    other for the front end; pearl's draft process takes that one), and the best fixed K with the engine
    bound to both cores, so sequential speculation gets the same cores as pearl."""
    names = {"no speculation", *(f"vLLM K={k}" for k in (1, 2, 3, 4)), "confidence 0.4 (default)"}
    full = full_plan()
    configs = [Config(**(c.to_dict() | {"timed": True})) for c in full.configs if c.name in names]
    both = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    configs.append(Config("vLLM K=3 (2 cores)", "vllm", "fixed K, 2 cores", 3, sweep=3, timed=True, env=both))
    configs += pearl_configs()
    # the draft on a thread of the engine's process: what sharing the interpreter lock costs
    thread = {"policy": "pearl", "draft_worker": "thread"}
    configs.append(Config("pearl K=4 (thread)", "plugin", "pearl thread", 4, thread, sweep=4, timed=True))
    # PEARL's own pre-verify: after a rejection the next step verifies no draft (the default, pre_draft 1,
    # makes one draft at once for it)
    own = {"policy": "pearl", "pre_draft": 0}
    configs += [
        Config(f"pearl K={k} pre_draft=0", "plugin", "pearl pre_draft=0", k, own, sweep=k, timed=True) for k in (2, 4)
    ]
    cells = [c for c in full.cells if c.timed and c.batch == 1 and c.temperature == 0.0]
    return Plan(configs, cells, notes=["pearl: batch 1, greedy, timed cells only; counts are the cells' own"])


def default_out(full: bool) -> Path:
    return REPO / "benchmarks" / "results" / ("harness" if full else "harness_short")
