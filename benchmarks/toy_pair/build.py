"""Rebuild the bundled toy draft/target pair from scratch, deterministically.

    .venv/bin/python -m benchmarks.toy_pair.build            # full rebuild (~50 min on 2 cores)
    .venv/bin/python -m benchmarks.toy_pair.build --smoke    # seconds; throwaway pair for plumbing

Stages: byte-level BPE tokenizer on the standard library's source; a
Qwen3ForCausalLM target trained by next-token loss; a smaller Qwen3 draft that
starts from the target's embedding and first layer and is distilled toward the
target's next-token distributions (forward KL), so the pair agrees the way
same-family pairs do. Weights are stored in bfloat16 (to keep the repository
small) with `dtype: float32` in the config, so both vLLM and transformers
compute in float32 by default. Seeds are fixed; the step counts are fixed, not
time-budgeted, so a rebuild gives the same pair up to floating-point
nondeterminism of the CPU kernels.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.toy_pair import corpus

log = logging.getLogger("build_toy_pair")

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "benchmarks" / "models"
PROMPTS = REPO / "benchmarks" / "prompts"
WORK = Path(__file__).resolve().parent / "_work"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


@dataclass
class PairConfig:
    vocab_size: int = 6144
    seq_len: int = 512
    # target
    target_layers: int = 4
    target_hidden: int = 256
    target_intermediate: int = 768
    target_steps: int = 1600
    target_batch: int = 16
    target_lr: float = 3e-3
    # draft
    draft_layers: int = 1
    draft_steps: int = 600
    draft_batch: int = 16
    draft_lr: float = 2e-3
    # shared
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    warmup: int = 50
    eval_windows: int = 64
    seed: int = 1234
    n_code_prompts: int = 200


def smoke_config() -> PairConfig:
    return PairConfig(
        vocab_size=1024,
        target_steps=4,
        draft_steps=4,
        target_batch=2,
        draft_batch=2,
        seq_len=128,
        eval_windows=2,
        n_code_prompts=8,
    )


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(files: list[corpus.SourceFile], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Every encoded prompt starts with BOS, in vLLM and in transformers alike.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1024
    )
    fast.save_pretrained(out_dir)
    return fast


def encode_stream(fast, files: list[corpus.SourceFile]) -> np.ndarray:
    ids = []
    for f in files:
        ids.extend(fast(f.text)["input_ids"])  # BOS + text
        ids.append(fast.eos_token_id)
    return np.asarray(ids, dtype=np.uint16)


# ---------------------------------------------------------------- models


def qwen3_config(cfg: PairConfig, layers: int, fast):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.target_hidden,
        intermediate_size=cfg.target_intermediate,
        num_hidden_layers=layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        dtype="float32",
    )


def batches(stream: np.ndarray, batch: int, seq_len: int, gen: torch.Generator):
    """Endless random windows of seq_len + 1 tokens: [B, T+1]."""
    n = len(stream) - seq_len - 1
    data = torch.from_numpy(stream.astype(np.int64))
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        yield torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])


def eval_windows(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """Evenly spaced held-out windows: [n, T+1]."""
    data = torch.from_numpy(stream.astype(np.int64))
    starts = np.linspace(0, len(stream) - seq_len - 2, n).astype(int)
    return torch.stack([data[s : s + seq_len + 1] for s in starts])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logits = model(w[:, :-1]).logits  # [B, T, V]
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train_loop(model, loss_fn, steps: int, batch_iter, peak_lr: float, warmup: int, label: str, evaluate) -> list[dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    history = []
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup)
        # bfloat16 autocast halves the step time on AVX512-BF16 CPUs; the
        # weights and optimizer state stay float32.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(next(batch_iter))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            row = {"step": step, "train_loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t0, 1)}
            if step % 200 == 0 or step == steps - 1:
                row["heldout"] = round(evaluate(), 4)
            log.info("%s %s", label, row)
            history.append(row)
    return history


def save_model(model, fast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in out_dir.glob("*"):
        p.unlink()
    # bfloat16 on disk halves the size; config keeps dtype float32 for compute.
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    cfg_path = out_dir / "config.json"
    conf = json.loads(cfg_path.read_text())
    conf["dtype"] = "float32"
    cfg_path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    fast.save_pretrained(out_dir)
    gen_cfg = out_dir / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()  # no sampling defaults: engines use the request's parameters
    model.to(torch.float32)


# ---------------------------------------------------------------- main


def build(cfg: PairConfig, models_dir: Path, prompts_dir: Path) -> dict:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    files = corpus.list_sources()
    train_files, heldout_files = corpus.split_sources(files)
    log.info("corpus: %d train files, %d held-out files", len(train_files), len(heldout_files))

    WORK.mkdir(exist_ok=True)
    fast = train_tokenizer(train_files, cfg.vocab_size, WORK / "tokenizer")
    train_stream = encode_stream(fast, train_files)
    heldout_stream = encode_stream(fast, heldout_files)
    log.info("tokens: train %d, held-out %d", len(train_stream), len(heldout_stream))
    windows = eval_windows(heldout_stream, cfg.eval_windows, cfg.seq_len)

    # Target: next-token cross-entropy.
    target = Qwen3ForCausalLM(qwen3_config(cfg, cfg.target_layers, fast))

    def target_loss(b):  # b: [B, T+1]
        logits = target(b[:, :-1]).logits  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten())

    gen = torch.Generator().manual_seed(cfg.seed)
    t_hist = train_loop(
        target,
        target_loss,
        cfg.target_steps,
        batches(train_stream, cfg.target_batch, cfg.seq_len, gen),
        cfg.target_lr,
        cfg.warmup,
        "target",
        lambda: heldout_loss(target, windows),
    )
    target.eval().requires_grad_(False)

    # Draft: starts from the target's embedding, first layers and final norm,
    # then forward KL toward the target's next-token distribution.
    draft = Qwen3ForCausalLM(qwen3_config(cfg, cfg.draft_layers, fast))
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for i in range(cfg.draft_layers):
        draft.model.layers[i].load_state_dict(target.model.layers[i].state_dict())
    draft.tie_weights()

    def draft_loss(b):
        x = b[:, :-1]
        with torch.no_grad():
            p_log = F.log_softmax(target(x).logits.float(), dim=-1)  # [B, T, V]
        q_log = F.log_softmax(draft(x).logits.float(), dim=-1)  # [B, T, V]
        return F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    d_hist = train_loop(
        draft,
        draft_loss,
        cfg.draft_steps,
        batches(train_stream, cfg.draft_batch, cfg.seq_len, gen),
        cfg.draft_lr,
        cfg.warmup,
        "draft",
        lambda: heldout_loss(draft, windows),
    )
    draft.eval()

    save_model(target, fast, models_dir / "toy-target")
    save_model(draft, fast, models_dir / "toy-draft")

    prompts = corpus.code_prompts(heldout_files, cfg.n_code_prompts, seed=cfg.seed)
    corpus.write_jsonl(prompts, prompts_dir / "code_heldout.jsonl")

    report = {
        "config": asdict(cfg),
        "corpus": {
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": int(len(train_stream)),
            "heldout_tokens": int(len(heldout_stream)),
        },
        "params": {
            "target": sum(p.numel() for p in target.parameters()),
            "draft": sum(p.numel() for p in draft.parameters()),
        },
        "tokens_trained": {
            "target": cfg.target_steps * cfg.target_batch * cfg.seq_len,
            "draft": cfg.draft_steps * cfg.draft_batch * cfg.seq_len,
        },
        "heldout_loss": {"target": heldout_loss(target, windows), "draft": heldout_loss(draft, windows)},
        "history": {"target": t_hist, "draft": d_hist},
    }
    (models_dir / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny, seconds-long build for plumbing checks")
    ap.add_argument("--models-dir", type=Path, default=MODELS)
    ap.add_argument("--prompts-dir", type=Path, default=PROMPTS)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    cfg = smoke_config() if args.smoke else PairConfig()
    report = build(cfg, args.models_dir, args.prompts_dir)
    log.info("held-out loss %s; params %s", report["heldout_loss"], report["params"])


if __name__ == "__main__":
    main()
