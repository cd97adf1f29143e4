"""Cost-scaled copies of a Qwen3 checkpoint that compute exactly the original's function.

    .venv/bin/python -m benchmarks.scaled_models --model benchmarks/models/toy-target --mlp-factor 32

On the toy pair vLLM's own per-step work dominates a target step, so wall
clock cannot show what speculation buys on a large target. A copy whose MLPs
are `factor` times wider costs like a bigger model but computes the same
function: the extra hidden units get deterministic random gate/up weights
and exactly-zero down-projection weights, so they add exact zeros to every
residual stream (silu(g) * u is finite, times 0.0 is 0.0). Only the
summation order of the down projection may change, so logits can differ in
the last bits; `check_function` measures that and whether every greedy token
agrees.

Copies are written under benchmarks/models/_scaled/ (ignored by git: hundreds
of MB), with a stamp naming the source's fingerprint, the factor and the
seed; an existing copy with the same stamp is reused. Drafters that read the
target's hidden states (EAGLE-3, DFlash) see the same hidden states from a
scaled target. A scaled draft model has other weights, so heads trained for
the original draft do not load on it (their fingerprint covers the weights);
its hidden states are the original's, so `restamped_head` writes a copy of a
head whose recorded draft is the scaled copy (same tensors, cached beside it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.paths import MODELS

SCALED = MODELS / "_scaled"
STAMP = "scaled_from.json"


def _fingerprint(model: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((model / name).read_bytes())
    return h.hexdigest()[:16]


def widen_mlps(state: dict[str, torch.Tensor], factor: int, seed: int, std: float) -> dict[str, torch.Tensor]:
    """Every layer's MLP `factor` times wider, same function. gate/up: [I, H] -> [f*I, H]; down: [H, I] -> [H, f*I]."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in sorted(state):
        if not name.endswith("mlp.down_proj.weight"):
            continue
        prefix = name.removesuffix("down_proj.weight")
        down = state[name]  # [H, I]
        hidden, inter = down.shape
        extra = (factor - 1) * inter
        for proj in ("gate_proj", "up_proj"):
            w = state[f"{prefix}{proj}.weight"]  # [I, H]
            fresh = torch.randn(extra, hidden, generator=gen, dtype=torch.float32).to(w.dtype) * std
            out[f"{prefix}{proj}.weight"] = torch.cat([w, fresh], dim=0).contiguous()
        out[name] = torch.cat([down, torch.zeros(hidden, extra, dtype=down.dtype)], dim=1).contiguous()
    return out


def scaled_copy(model: Path, mlp_factor: int, out: Path | None = None, seed: int = 0) -> Path:
    """Write (or reuse) the cost-scaled copy of `model`; returns its directory."""
    model = Path(model)
    if mlp_factor < 1:
        raise ValueError(f"mlp_factor: {mlp_factor!r} must be >= 1")
    out = Path(out) if out else SCALED / f"{model.name}-mlp{mlp_factor}"
    stamp = {"source": str(model), "source_fingerprint": _fingerprint(model), "mlp_factor": mlp_factor, "seed": seed}
    if (out / STAMP).exists() and json.loads((out / STAMP).read_text()) == stamp:
        return out
    config = json.loads((model / "config.json").read_text())
    if config.get("model_type") != "qwen3":
        raise ValueError(f"model: {model} is a {config.get('model_type')!r} checkpoint; only qwen3 is supported")
    state = load_file(str(model / "model.safetensors"))
    std = float(config.get("initializer_range", 0.02))
    wide = widen_mlps(state, mlp_factor, seed, std)
    if config.get("tie_word_embeddings") and "lm_head.weight" in wide:
        del wide["lm_head.weight"]  # tied: stored once, as the original does
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)  # a half-written copy never looks finished
    for f in model.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", STAMP):
            shutil.copy2(f, out / f.name)
    config["intermediate_size"] = config["intermediate_size"] * mlp_factor
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(wide, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    return out


def use_scaled_copies(target_factor: int, draft_factor: int) -> str:
    """Point this process and the engines it starts at cost-scaled copies of the bundled pair (built
    once, cached) through benchmarks.paths' environment variables; returns an out-dir suffix
    ("_target-mlp32_draft-mlp20", "" when nothing is scaled). Modules that read benchmarks.paths
    (benchmarks.vllm_run) must be imported after this."""
    import importlib
    import os

    from benchmarks import paths

    suffix = ""
    if target_factor > 1:
        os.environ[paths.TARGET_ENV] = str(scaled_copy(paths.TARGET, target_factor))
        suffix += f"_target-mlp{target_factor}"
    if draft_factor > 1:
        os.environ[paths.DRAFT_ENV] = str(scaled_copy(paths.DRAFT, draft_factor))
        suffix += f"_draft-mlp{draft_factor}"
    importlib.reload(paths)
    return suffix


def restamped_head(head: Path, scaled_draft: Path) -> Path:
    """A copy of a trained head file that records `scaled_draft` as its draft: the scaled copy computes
    the original draft's function (same hidden states, same tokens), so the head's inputs are unchanged.
    Its metadata keeps the original draft under `restamped_from`. Written under the scaled draft's folder."""
    from vllm_adaptive_spec.heads.fileformat import draft_identity, load_head_file, save_head_file

    head, scaled_draft = Path(head), Path(scaled_draft)
    stamp = json.loads((scaled_draft / STAMP).read_text())
    loaded = load_head_file(head, "head")
    original = loaded.meta.get("draft", {})
    if original.get("fingerprint") != draft_identity(stamp["source"])["fingerprint"]:
        raise ValueError(f"head: {head} was not trained for {stamp['source']}, the scaled copy's source")
    out = scaled_draft / "heads" / head.name
    meta = {k: v for k, v in loaded.meta.items() if k != "format_version"}
    meta |= {"draft": draft_identity(scaled_draft), "restamped_from": original}
    save_head_file(out, loaded.tensors, meta)
    return out


def check_function(original: Path, scaled: Path, token_ids: list[list[int]]) -> dict:
    """HF logits of both checkpoints on the same sequences: max |difference| and greedy agreement."""
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(str(original), dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(scaled), dtype=torch.float32).eval()
    max_diff, agree, total, identical = 0.0, 0, 0, True
    with torch.no_grad():
        for ids in token_ids:
            x = torch.tensor([ids])
            la, lb = a(x).logits[0], b(x).logits[0]  # [T, V]
            identical &= torch.equal(la, lb)
            max_diff = max(max_diff, float((la - lb).abs().max()))
            agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
            total += la.shape[0]
    return {"max_abs_logit_diff": max_diff, "bit_identical": bool(identical), "greedy_agree": agree, "positions": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a Qwen3 checkpoint directory")
    ap.add_argument("--mlp-factor", type=int, required=True, help="how many times wider every MLP gets")
    ap.add_argument("--out", type=Path, help="output directory (default benchmarks/models/_scaled/NAME-mlpF)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = scaled_copy(args.model, args.mlp_factor, args.out, args.seed)
    from transformers import AutoTokenizer

    from benchmarks.paths import load_prompts

    tok = AutoTokenizer.from_pretrained(str(args.model))
    ids = [tok(p).input_ids for p in load_prompts("code_heldout", 4)]
    check = check_function(args.model, out, ids)
    (out / "function_check.json").write_text(json.dumps(check, indent=1) + "\n")
    print(json.dumps({"out": str(out), **check}, indent=1))
    if check["greedy_agree"] != check["positions"]:
        raise SystemExit("the scaled copy's greedy tokens differ from the original's")


if __name__ == "__main__":
    main()
