"""PEARL's parallel draft on a GPU: does the draft thread's CUDA stream overlap the target's pass?

    python3 -m benchmarks.gpu_pearl --out DIR          # on a CUDA machine
    python -m benchmarks.gpu_pearl --tiny --out DIR    # the same code at toy sizes on CPU (a check)

vLLM is not on the GPU machines, so this runs the parts of `pearl` that are ours: the draft worker
of parallel_draft.py (`DraftThread` with `DenseDraft`, the draft's own dense model on its own CUDA
stream, the GPU default) beside a target pass (benchmarks.gpu_costs' Llama-3.1-8B-sized stack,
replayed from a CUDA graph on the default stream, verifying 5 tokens against a 1024-token context).
The draft is a Qwen3-0.6B-sized model with random weights. Per repeat, interleaved:
- target alone: one pass;
- draft alone: 8 greedy tokens on the thread (`until_asked` off);
- both: the thread drafts until asked while the pass runs; the pass's time, and how many drafts
  the thread made by the time the engine asked (after the pass);
- the draft on the main thread: from its decode graphs (what the thread runs on CUDA), and a draft
  that runs its ops eagerly (`_eager`: the path before the graphs).
Medians over repeats. The draft's tokens are random-weight greedy tokens: only the timing matters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu_costs import LLAMA_8B, TINY, causal_tail, graphed, kv_cache, target_forward, target_weights
from vllm_adaptive_spec.parallel_draft import DenseDraft, DraftThread

QWEN3_06B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}
TINY_DRAFT = QWEN3_06B | {
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
}


def random_qwen3(conf: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named random weights for a Qwen3 config (what DenseDraft reads)."""
    h, d, inter = conf["hidden_size"], conf["head_dim"], conf["intermediate_size"]
    nh, nkv = conf["num_attention_heads"], conf["num_key_value_heads"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) * 0.02

    out = {"model.embed_tokens.weight": w(conf["vocab_size"], h), "model.norm.weight": torch.ones(h, device=device)}
    for i in range(conf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": w(nh * d, h),
            p + "self_attn.k_proj.weight": w(nkv * d, h),
            p + "self_attn.v_proj.weight": w(nkv * d, h),
            p + "self_attn.o_proj.weight": w(h, nh * d),
            p + "self_attn.q_norm.weight": torch.ones(d, device=device),
            p + "self_attn.k_norm.weight": torch.ones(d, device=device),
            p + "input_layernorm.weight": torch.ones(h, device=device),
            p + "post_attention_layernorm.weight": torch.ones(h, device=device),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU: checks the code, times nothing real")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    device = torch.device("cpu") if args.tiny else torch.device("cuda", torch.cuda.current_device())
    s, conf = (TINY, TINY_DRAFT) if args.tiny else (LLAMA_8B, QWEN3_06B)
    dtype = torch.bfloat16
    torch.manual_seed(0)

    verify = 5  # a round of 4 drafts and the bonus token
    w = target_weights(s, dtype, device)
    cache = kv_cache(s, s.layers, 1, verify, dtype, device)
    tokens = torch.zeros(1, verify, dtype=torch.long, device=device)
    mask = causal_tail(verify, s.context, device)
    target = graphed(lambda: target_forward(w, s, cache, tokens, mask), device)

    draft = DenseDraft(
        conf,
        random_qwen3(conf, device, dtype),
        max_len=s.context + 64 * (args.repeats + 2) * 3,
        device=device,
        dtype=dtype,
    )
    thread = DraftThread(draft, None, device)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, conf["vocab_size"], s.context)  # the prompt: prefilled once below
    thread.submit(seq, 1, until_asked=False)
    thread.collect()

    def main_stream_sync() -> None:  # the target's stream only: the draft thread's stream runs on
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def target_pass() -> float:
        main_stream_sync()
        t0 = time.perf_counter()
        target()
        main_stream_sync()
        return 1e3 * (time.perf_counter() - t0)

    got: dict[str, list[float]] = {k: [] for k in ("target_ms", "draft_ms_per_token", "both_target_ms", "both_drafts")}
    for _ in range(2):  # warm-up
        target_pass()
    for r in range(args.repeats + 1):
        # draft alone: 8 tokens after the sequence as it stands
        t0 = time.perf_counter()
        thread.submit(seq, 8, until_asked=False)
        alone = thread.collect()
        draft_ms = 1e3 * (time.perf_counter() - t0) / len(alone)
        seq = np.concatenate([seq, alone[:4]])  # "accepted": the next job reuses the cache
        # target alone
        target_ms = target_pass()
        # both: the thread drafts until the engine asks, the pass runs meanwhile
        thread.submit(seq, 64)
        both_ms = target_pass()
        drafts = thread.collect()
        seq = np.concatenate([seq, drafts[:4]])
        if r == 0:
            continue  # warm-up round
        for k, v in zip(got, (target_ms, draft_ms, both_ms, len(drafts))):
            got[k].append(v)
    thread.close()
    # The same draft on the main thread, no worker (what the worker's hand-off costs), beside a draft
    # that runs its ops eagerly (the path before the decode graphs; the CPU's path); taking turns.
    eager = DenseDraft(conf, random_qwen3(conf, device, dtype), max_len=len(seq) + 64, device=device, dtype=dtype)
    eager.continue_greedy(seq.tolist(), 1)  # the prompt, once
    more = rng.integers(0, conf["vocab_size"], 40)  # "accepted" tokens, 8 more each repeat

    def ms_per_token(d: DenseDraft, tokens: list[int]) -> float:
        main_stream_sync()
        t0 = time.perf_counter()
        out = d.continue_greedy(tokens, 8)
        main_stream_sync()
        return 1e3 * (time.perf_counter() - t0) / len(out)

    got["draft_ms_per_token_main_thread"], got["draft_ms_per_token_eager_main_thread"] = [], []
    for r in range(6):
        tokens = np.concatenate([seq, more[: 8 * r]]).tolist()
        order = (("graphed", draft), ("eager", eager))[:: 1 if r % 2 else -1]  # the order rotated
        pair = {name: ms_per_token(d, tokens) for name, d in order}
        if r > 0:  # the first repeat warms up
            got["draft_ms_per_token_main_thread"].append(pair["graphed"])
            got["draft_ms_per_token_eager_main_thread"].append(pair["eager"])
    med = {k: statistics.median(v) for k, v in got.items()}
    med["drafts_alone_in_a_pass"] = med["target_ms"] / med["draft_ms_per_token"]
    doc = {
        "device": "cpu (tiny check)" if args.tiny else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "target": "Llama-3.1-8B-sized stack, 1 x 5 tokens, CUDA graph" if not args.tiny else "tiny",
        "draft": conf,
        "repeats": args.repeats,
        "median": {k: round(v, 4) for k, v in med.items()},
        "runs": got,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_pearl.json").write_text(json.dumps(doc, indent=1))
    print("json:", json.dumps(doc["median"]))
    print(f"saved {out}/gpu_pearl.json")


if __name__ == "__main__":
    main()
