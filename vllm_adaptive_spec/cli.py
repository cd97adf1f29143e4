"""Command line: `vllm-adaptive-spec train specdecpp|pacer|eagle3|dflash ...` (also `python -m vllm_adaptive_spec.cli`).

    vllm-adaptive-spec train specdecpp --target benchmarks/models/toy-target \\
        --draft benchmarks/models/toy-draft --prompts benchmarks/prompts/code_train.jsonl \\
        --out heads/toy/specdecpp.safetensors

Runs SpecDec++ head training end to end: target responses through vLLM,
teacher-forced labels, head training, evaluation, threshold choice; writes the
head and a JSON report next to it (`<out stem>.report.json`). `train pacer`
does the same for the Pacer pre-verifier (draft chains, packed BCE training,
block size / threshold / growth chosen by replay); with `--drafter eagle3`
both train on an EAGLE-3 head's own greedy chains. `train eagle3` trains an
EAGLE-3 draft head for the target with the training-time test and writes the
directory vLLM loads with `speculative_config={"method": "eagle3", "model":
<out>}`; the report goes beside it (`<out>.report.json`), outside the
directory vLLM reads. `train dflash` does the same for a DFlash parallel
block drafter (`--loss ce|decay|dpace`; `speculative_config={"method":
"dflash", "model": <out>, "num_speculative_tokens": K}`).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from pathlib import Path

logger = logging.getLogger("vllm_adaptive_spec.cli")


def _read_prompts(path: Path, n: int | None) -> list[str]:
    with path.open() as fh:
        rows = [json.loads(line)["prompt"] for line in fh if line.strip()]
    return rows if n is None else rows[:n]


def _responses(args: argparse.Namespace):
    from vllm_adaptive_spec.training import data

    modes = tuple(args.responses_modes.split(","))
    if args.responses is not None and args.responses.exists():
        responses = data.load_responses(args.responses)
        logger.info("reusing %d target responses from %s", len(responses), args.responses)
        return responses
    from vllm_adaptive_spec.integration.datagen import generate_responses

    prompts = _read_prompts(args.prompts, args.n_prompts)
    responses = generate_responses(args.target, prompts, args.max_tokens, modes, args.temperature, args.seed)
    if args.responses is not None:
        data.save_responses(responses, args.responses)
    return responses


def _report_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".safetensors") + ".report.json")


def _run_training(args: argparse.Namespace, module: str, train_name: str) -> tuple[dict, Path]:
    """Shared steps of every `train` subcommand: threads, responses, the pipeline's TrainConfig
    from the options given, the pipeline itself, the JSON report beside its output."""
    import importlib

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    pipeline = importlib.import_module(f"vllm_adaptive_spec.training.{module}")
    responses = _responses(args)
    if args.n_responses:
        responses = responses[: args.n_responses]
    config_class = pipeline.TrainConfig
    cfg = config_class(
        **{f.name: getattr(args, f.name) for f in fields(config_class) if getattr(args, f.name, None) is not None}
    )
    extra = {"prompts": str(args.prompts), "max_tokens": args.max_tokens}
    drafter = () if getattr(args, "draft", None) is None else (args.draft,)
    report = getattr(pipeline, train_name)(args.target, *drafter, responses, args.out, cfg, extra)
    report_path = _report_path(args.out)
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    return report, report_path


def _train_pacer(args: argparse.Namespace) -> None:
    if args.drafter == "eagle3":  # the head's own chains (training/pacer_eagle3.py)
        report, report_path = _run_training(args, "pacer_eagle3", "train_pacer_eagle3")
    else:
        report, report_path = _run_training(args, "pacer", "train_pacer")
    m, meta = report["metrics"], report["meta"]
    print(
        f"pre-verifier: {args.out} ({report['parameters']:,} parameters); BCE train {m['train']['bce']:.4f}, "
        f"held-out {m['heldout']['bce']:.4f}, held-out accuracy {m['heldout']['accuracy']:.4f}; "
        f"block {meta['block_size']}, threshold {meta['threshold']}, growth {meta['growth']}\nreport: {report_path}"
    )


def _train_specdecpp(args: argparse.Namespace) -> None:
    if args.drafter == "eagle3":  # the head's own chains (training/specdecpp_eagle3.py)
        report, report_path = _run_training(args, "specdecpp_eagle3", "train_specdecpp_eagle3")
    else:
        report, report_path = _run_training(args, "specdecpp", "train_specdecpp")
    m = report["metrics"]
    print(
        f"head: {args.out} ({report['parameters']:,} parameters); binary KL train {m['train']['binary_kl']:.4f}, "
        f"held-out {m['heldout']['binary_kl']:.4f}; recommended threshold {report['meta']['recommended_threshold']}"
        f"\nreport: {report_path}"
    )


def _train_eagle3(args: argparse.Namespace) -> None:
    report, report_path = _run_training(args, "eagle3", "train_eagle3")
    held, chains = report["metrics"]["heldout"], report["metrics"]["heldout_chains"]
    print(
        f"EAGLE-3 head: {args.out} ({report['parameters']:,} parameters); held-out agreement per step "
        f"{held['agreement_per_step']}; replayed acceptance length {chains['replay_acceptance_length']} "
        f"at K={chains['cap']}; {report['seconds']['total']} s\nreport: {report_path}"
    )


def _train_dflash(args: argparse.Namespace) -> None:
    report, report_path = _run_training(args, "dflash", "train_dflash")
    held = report["metrics"]["heldout"]
    print(
        f"DFlash drafter ({report['config']['loss']}): {args.out} ({report['parameters']:,} parameters); held-out "
        f"agreement per position {held['agreement_per_position']}; replayed acceptance length "
        f"{held['replay_acceptance_length']} at K={held['block_size']}; {report['seconds']['total']} s"
        f"\nreport: {report_path}"
    )


def _tune(args: argparse.Namespace) -> None:
    """Thresholds of svip and confidence for a drafter at one cost ratio or on a cost file (training/tune.py)."""
    import torch

    from vllm_adaptive_spec.training.tune import TuneConfig, drafter_kind, tune

    if args.threads:
        torch.set_num_threads(args.threads)
    args.drafter = args.drafter or drafter_kind(args.draft)
    cfg = TuneConfig(
        **{f.name: getattr(args, f.name) for f in fields(TuneConfig) if getattr(args, f.name, None) is not None}
    )
    extra = {"prompts": str(args.prompts), "max_tokens": args.max_tokens}
    report = tune(args.target, args.draft, _responses(args), cfg, extra)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    r = report["replay"]
    fixed = r["best_fixed"]
    print(f"best fixed K: K={fixed['fixed_k']} (S {fixed['speedup']}); oracle S {r['oracle']['speedup']}")
    for policy, v in r["policies"].items():
        best = v["best"]
        setting = {"adaptive_spec": {"policy": policy, "threshold": best["threshold"]}}
        print(f"{policy}: S {best['speedup']}, tau {best['tau']}; additional_config={json.dumps(setting)}")
    print(f"report: {args.out}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm-adaptive-spec", description="vllm-adaptive-spec tools")
    sub = ap.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a stopping head").add_subparsers(dest="head", required=True)
    sp = train.add_parser("specdecpp", help="SpecDec++ acceptance head")
    _common_options(sp)
    sp.add_argument("--mode", choices=("greedy", "sampling"), help="label mode (default greedy)")
    _drafter_option(sp)
    for name in ("depth", "epochs", "batch_size", "cap", "replay_responses"):
        sp.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    for name in ("weight", "mix", "lr", "weight_decay", "val_frac", "cost_ratio"):
        sp.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float)
    sp.set_defaults(run=_train_specdecpp)
    pc = train.add_parser("pacer", help="Pacer blockwise pre-verifier")
    _common_options(pc)
    _drafter_option(pc)
    pc.add_argument("--halting", choices=("mean", "any", "last"), help="halting rule for the replay (default mean)")
    pc.add_argument("--no-position", dest="use_position", action="store_const", const=False, help="ablation: no e_i")
    for name in (
        "chain_length",
        "train_stride",
        "window",
        "num_heads",
        "mlp_size",
        "max_draft",
        "epochs",
        "batch_size",
        "cap",
        "replay_responses",
    ):
        pc.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    for name in ("lr", "weight_decay", "val_frac", "cost_ratio", "layer_cost"):
        pc.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float)
    pc.set_defaults(run=_train_pacer)
    e3 = train.add_parser("eagle3", help="EAGLE-3 draft head (a vLLM eagle3 model directory)")
    _common_options(e3, draft=False)
    e3.add_argument(
        "--aux-layer-ids", type=lambda v: tuple(int(x) for x in v.split(",")), help="target layer ids, e.g. 1,2,3"
    )
    for name in ("ttt_steps", "epochs", "batch_size", "cap", "eval_responses", "intermediate_size"):
        e3.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    for name in ("step_decay", "lr", "weight_decay", "warmup_frac", "val_frac"):
        e3.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float)
    e3.set_defaults(run=_train_eagle3)
    df = train.add_parser("dflash", help="DFlash parallel block drafter (a vLLM dflash model directory)")
    _common_options(df, draft=False)
    df.add_argument("--loss", choices=("ce", "decay", "dpace"), help="position weighting (default dpace)")
    df.add_argument("--dpace-lambda", "--lambda", dest="dpace_lambda", type=float, help="D-PACE smoothing (0.5)")
    df.add_argument(
        "--dpace-estimate",
        choices=("confidence", "agreement"),
        help="D-PACE q_k: the per-block confidence (default, the paper's) or a running per-position agreement",
    )
    df.add_argument(
        "--target-layer-ids", type=lambda v: tuple(int(x) for x in v.split(",")), help="DFlash ids, e.g. 0,1,2"
    )
    for name in ("block_size", "num_layers", "intermediate_size", "epochs", "anchors", "batch_size", "eval_responses"):
        df.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    for name in ("gamma", "estimate_momentum", "lr", "weight_decay", "warmup_frac", "val_frac"):
        df.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float)
    df.set_defaults(run=_train_dflash)
    tu = sub.add_parser("tune", help="svip and confidence thresholds for a drafter, by replay on training data")
    _common_options(tu)
    tu.add_argument(
        "--drafter",
        choices=("eagle3", "dflash", "draft_model"),
        help="what --draft is: an EAGLE-3 head directory, a DFlash block drafter's (choose it on --costs), or an "
        "independent draft model's (default: read from its config.json)",
    )
    tu.add_argument("--cost-ratio", dest="cost_ratio", type=float, help="c = t_T / t_D to choose for (default 4)")
    tu.add_argument(
        "--costs",
        help="choose on a cost file's batch-1 curves instead of c: each pass priced by how many drafts it verifies "
        "(benchmarks: the regime harness writes step_costs_<workload>.json, benchmarks.step_costs costs.json)",
    )
    for name in ("cap", "replay_responses"):
        tu.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    tu.add_argument("--val-frac", dest="val_frac", type=float, help="held-out share of the training prompts (0.1)")
    tu.set_defaults(run=_tune)
    return ap


def _drafter_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--drafter",
        choices=("draft_model", "eagle3"),
        default="draft_model",
        help="what --draft is: a draft model, or an EAGLE-3 head directory (greedy chains of the head)",
    )


def _common_options(sp: argparse.ArgumentParser, draft: bool = True) -> None:
    sp.add_argument("--target", type=Path, required=True, help="target model directory")
    if draft:
        sp.add_argument("--draft", type=Path, required=True, help="draft model directory (the head is tied to it)")
    sp.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'prompt' field per line")
    sp.add_argument("--out", type=Path, required=True, help="head file (.safetensors) or directory (eagle3) to write")
    sp.add_argument("--n-prompts", type=int, help="use the first N prompts")
    sp.add_argument("--n-responses", type=int, help="use the first N cached responses")
    sp.add_argument("--max-tokens", type=int, default=128, help="target response length")
    sp.add_argument("--responses-modes", default="greedy", help="target responses: greedy,sampled")
    sp.add_argument("--responses", type=Path, help="JSONL cache of target responses: reused if present, else written")
    sp.add_argument("--temperature", type=float, default=1.0, help="sampled responses and sampling-mode labels")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--threads", type=int, help="torch CPU threads for labelling and training (1 on a busy machine)")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.run(args)


if __name__ == "__main__":
    main()
