"""Draft-step, verification and policy costs at real sizes on a GPU, without vLLM.

    python3 -m benchmarks.gpu_costs --out DIR          # on a CUDA machine (forwards as CUDA graphs)
    python -m benchmarks.gpu_costs --tiny --out DIR    # the same code at toy sizes on CPU (a check)

The GPU machines this project borrows have PyTorch, not vLLM, so this times with plain PyTorch
the parts that set a GPU's economics of adaptive drafting, at Llama-3.1-8B sizes (random bfloat16
weights: costs do not depend on values) with an EAGLE-3 head of that width:
- verify_ms: one target forward over B requests x q tokens each against a 1024-token context,
  logits for every token (vLLM's verification pass, without its sampler and bookkeeping);
- draft_step_ms: one step of the EAGLE-3 head (heads.eagle3's layer; a 32000-token draft
  vocabulary, as the public Llama-3.1-8B EAGLE-3 heads have) for B rows;
- per draft step at each B: vLLM's loop (graph replay, argmax, one host copy when the round ends)
  against the plugin's (graph replay, argmax, `policy_logprobs`, the policy's `decide`, one host
  copy of the decisions per step: policies.step, the functions the plugin's loop runs), for fixed,
  svip, confidence, SpecDec++ and Pacer with heads as wide as the draft (random weights). Both loops
  do the tensor ops of vLLM's per-step bookkeeping (`Loops.prepare`); the plugin's rows prepare the
  next step before waiting for the decisions (its order on CUDA), and one row, fixed, after it.
Configurations take turns within each repeat (order rotated); figures are medians of repeats.
Not modelled: the Python of vLLM's attention-metadata builders per draft step, which its loop
overlaps with the GPU and the plugin's loop overlaps only when it prepares ahead.

Writes DIR/gpu_costs.json (everything) and DIR/costs.json (a cost file the plugin and harness read).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_adaptive_spec.heads.cuda_graph import RowGraphs, capture
from vllm_adaptive_spec.heads.eagle3 import Eagle3Config, Eagle3Head, apply_rope, rope_cos_sin
from vllm_adaptive_spec.heads.pacer import PacerConfig, PacerLayer, save_pacer
from vllm_adaptive_spec.heads.specdecpp import SpecDecHead, SpecDecHeadConfig, save_specdecpp
from vllm_adaptive_spec.policies import POLICY_CLASSES, StopPolicy
from vllm_adaptive_spec.policies.step import decisions_to_host, policy_logprobs


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    inter: int = 14336
    vocab: int = 128256
    draft_vocab: int = 32000
    context: int = 1024  # cached tokens every query attends to


LLAMA_8B = Shape()
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512, draft_vocab=256, context=32)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GQA without copying keys: q [B, nh, T, d], k and v [B, nkv, S, d], mask [T, S] bool -> [B, nh, T, d].
    The g = nh / nkv query heads of a kv head ride as extra query rows of that head."""
    b, nh, t, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    qg = q.reshape(b, nkv, g * t, d)  # row j * t + i: query head kv * g + j, token i
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(g, 1))
    return o.view(b, nh, t, d)


def causal_tail(t: int, context: int, device: torch.device) -> torch.Tensor:
    """[t, context + t] bool: every new token sees the context and the new tokens up to itself."""
    return torch.ones(t, context + t, dtype=torch.bool, device=device).tril(context)


# -- the target: a Llama-shaped stack with a static KV cache --


def target_weights(s: Shape, dtype: torch.dtype, device: torch.device) -> dict:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device) * 0.02

    layers = [
        {
            "norm1": torch.ones(s.hidden, dtype=dtype, device=device),
            "qkv": w((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),  # fused, as vLLM runs it
            "o": w(s.hidden, s.heads * s.head_dim),
            "norm2": torch.ones(s.hidden, dtype=dtype, device=device),
            "gate_up": w(2 * s.inter, s.hidden),
            "down": w(s.hidden, s.inter),
        }
        for _ in range(s.layers)
    ]
    return {
        "embed": w(s.vocab, s.hidden),
        "layers": layers,
        "norm": torch.ones(s.hidden, dtype=dtype, device=device),
        "lm_head": w(s.vocab, s.hidden),
    }


def target_forward(w: dict, s: Shape, cache: list, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] after s.context cached tokens -> logits [B * T, V]; cache: per layer (k, v)
    [B, nkv, context + T, d] (the new keys land in the last T slots)."""
    b, t = tokens.shape
    d = s.head_dim
    pos = torch.arange(s.context, s.context + t, device=tokens.device).expand(b, t)
    cos, sin = (c[:, None].to(w["embed"].dtype) for c in rope_cos_sin(pos, d, 500000.0))  # [B, 1, T, d]
    x = F.embedding(tokens, w["embed"])  # [B, T, H]
    for lw, (kc, vc) in zip(w["layers"], cache):
        h = F.rms_norm(x, (s.hidden,), lw["norm1"], 1e-5)
        q, k, v = F.linear(h, lw["qkv"]).split([s.heads * d, s.kv_heads * d, s.kv_heads * d], -1)
        q = apply_rope(q.view(b, t, -1, d).transpose(1, 2), cos, sin)
        kc[:, :, s.context :] = apply_rope(k.view(b, t, -1, d).transpose(1, 2), cos, sin)
        vc[:, :, s.context :] = v.view(b, t, -1, d).transpose(1, 2)
        o = grouped_attention(q, kc, vc, mask)  # [B, nh, T, d]
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), lw["o"])
        gate, up = F.linear(F.rms_norm(x, (s.hidden,), lw["norm2"], 1e-5), lw["gate_up"]).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, lw["down"])
    return F.linear(F.rms_norm(x, (s.hidden,), w["norm"], 1e-5), w["lm_head"]).view(b * t, -1)


def kv_cache(s: Shape, layers: int, b: int, t: int, dtype: torch.dtype, device: torch.device) -> list:
    return [
        tuple(torch.randn(b, s.kv_heads, s.context + t, s.head_dim, dtype=dtype, device=device) for _ in "kv")
        for _ in range(layers)
    ]


# -- the draft: one EAGLE-3 head step with a static KV cache --


def eagle3_head(s: Shape, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    cfg = Eagle3Config(
        hidden_size=s.hidden,
        target_hidden_size=s.hidden,
        intermediate_size=s.inter,
        num_heads=s.heads,
        num_kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        vocab_size=s.draft_vocab,
    )
    with torch.device(device):
        return Eagle3Head(cfg).to(dtype).eval().requires_grad_(False)


def draft_step(head: Eagle3Head, cache: tuple, tokens: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor):
    """tokens [B, 1], hidden [B, 1, H] (the previous step's prenorm output) -> (logits [B, Vd],
    final hidden [B, H], prenorm [B, 1, H]); the step's key lands in the cache's last slot."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    b = tokens.shape[0]
    ctx = cache[0].shape[2] - 1
    pos = torch.full((b, 1), ctx, device=tokens.device)
    q, k, v = attn.qkv(layer.attn_input(head.embed_tokens(tokens), hidden), pos)  # RoPE leaves q, k float32
    cache[0][:, :, ctx:], cache[1][:, :, ctx:] = k, v
    o = grouped_attention(q.to(cache[0].dtype), cache[0], cache[1], mask)
    prenorm = layer.finish(hidden, attn.out(o))
    normed = head.norm(prenorm)[:, 0]
    return head.lm_head(normed), normed, prenorm


# -- capture and timing --


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """fn reads static input buffers; on CUDA its kernels are captured once and replayed."""
    return capture(fn, device) if device.type == "cuda" else fn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Wall-clock ms per call over `iters` calls (the device drained before and after)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return 1e3 * (time.perf_counter() - start) / iters


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, iters: int, repeats: int) -> dict:
    """Median ms per call of each fn; every repeat runs them all, the order rotated."""
    names = list(fns)
    for name in names:  # warm-up
        time_ms(fns[name], device, 2)
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            got[name].append(time_ms(fns[name], device, iters))
    return {n: round(statistics.median(v), 4) for n, v in got.items()}


# -- the draft loops --


def heads_dir(s: Shape, tmp: Path) -> dict[str, str]:
    """Head files as wide as the draft (random weights), for the trained policies."""
    meta = {"draft": {"name": "gpu-costs", "fingerprint": "none"}, "recommended_threshold": 0.5}
    save_specdecpp(tmp / "specdecpp.safetensors", SpecDecHead(SpecDecHeadConfig(s.hidden)), meta)
    pcfg = PacerConfig(hidden_size=s.hidden)
    pmeta = meta | {"block_size": 2, "threshold": 0.9, "growth": 1.03, "halting": "mean", "context_window": 64}
    save_pacer(tmp / "pacer.safetensors", PacerLayer(pcfg), pmeta)
    return {"specdecpp": str(tmp / "specdecpp.safetensors"), "pacer": str(tmp / "pacer.safetensors")}


def make_policy(name: str, heads: dict[str, str], device: torch.device) -> StopPolicy:
    params = {"head": heads[name]} if name in heads else {}
    policy = POLICY_CLASSES[name](**params)
    policy.device = device
    return policy


class Loops:
    """One drafting batch of B rows: the captured head step and the two loops around it."""

    def __init__(self, head: Eagle3Head, s: Shape, b: int, k: int, dtype: torch.dtype, device: torch.device):
        self.b, self.k, self.device, self.hidden = b, k, device, s.hidden
        self.cache = kv_cache(s, 1, b, 1, dtype, device)[0]
        self.mask = causal_tail(1, s.context, device)
        self.tokens = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.prev = torch.randn(b, 1, s.hidden, dtype=dtype, device=device)
        self.step = graphed(lambda: draft_step(head, self.cache, self.tokens, self.prev, self.mask), device)
        self.round_no = 0
        # what vLLM's step bookkeeping reads and writes (prepare): 16-token KV blocks, one table row per request
        blocks = s.context // 16 + 1
        with torch.device(device):
            self.block_table = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks)
            self.positions = torch.full((b,), s.context - 1, dtype=torch.long)
            self.seq_lens = torch.full((b,), s.context, dtype=torch.int32)
            self.slots = torch.zeros(b, dtype=torch.long)

    def prepare(self, tokens: torch.Tensor, prenorm: torch.Tensor) -> None:
        """The host work before a draft step, of vLLM's kind: positions, slot mapping and sequence
        lengths one further, the last token [B] and state [B, 1, H] into the step's input buffers.
        Its tensor ops only (a lower bound: vLLM's attention-metadata builders add Python work); the
        captured step reads a fixed context, so positions wrap and rounds repeat."""
        torch.remainder(self.positions + 1, self.mask.shape[-1], out=self.positions)
        block = self.block_table.gather(1, (self.positions // 16)[:, None])[:, 0]  # [B]
        torch.add(block.long() * 16, self.positions % 16, out=self.slots)
        self.seq_lens.copy_(self.positions + 1)
        self.tokens.copy_(tokens[:, None])
        self.prev.copy_(prenorm)

    def vllm_round(self) -> list[list[int]]:
        """vLLM's greedy loop: no host copy until the round's drafts go to the scheduler."""
        drawn = []
        for _ in range(self.k):
            logits, _, prenorm = self.step()
            tokens = logits.argmax(-1)  # [B]
            self.prepare(tokens, prenorm)
            drawn.append(tokens)
        return torch.stack(drawn, 1).tolist()

    def plugin_round(self, policy: StopPolicy, ahead: bool = True) -> list[list[int]]:
        """The plugin's greedy loop with `policy`, every row drafting all k steps (its decisions
        are computed and copied to the host each step, as in the loop, but not obeyed). `ahead`:
        the next step is prepared before the wait for this step's decisions (prepare_ahead, the
        plugin's order on CUDA), else after it (its order on CPU)."""
        ids = [f"r{i}" for i in range(self.b)]
        policy.round_limits(ids, self.k)
        if policy.observes_context:  # two verified tokens per request per round
            ctx = torch.randn(2 * self.b, self.hidden, dtype=self.prev.dtype, device=self.device)
            pos = 2 * self.round_no
            policy.observe_context(ids, ctx, list(range(0, 2 * self.b, 2)), [2] * self.b, [pos] * self.b)
        self.round_no += 1
        drawn = []
        for t in range(self.k):
            logits, normed, prenorm = self.step()
            logits = logits.float()
            tokens = logits.argmax(-1)  # [B]
            decision = policy.decide(policy_logprobs(logits, None), tokens, t, normed)
            if ahead:
                self.prepare(tokens, prenorm)
            decisions_to_host(decision.keep, decision.stop, None)
            if not ahead:
                self.prepare(tokens, prenorm)
            drawn.append(tokens)
        return torch.stack(drawn, 1).tolist()


def head_forward_us(s: Shape, device: torch.device, b: int, iters: int, repeats: int) -> dict:
    """The SpecDec++ head's forward alone: as the policy runs it (heads.affine; float32 on CPU, replayed
    from a CUDA graph on a GPU: "graphed"), eagerly, through F.linear, in bfloat16, and a narrow head
    (H -> 256, then the same blocks at 256)."""
    with torch.device(device):
        head = SpecDecHead(SpecDecHeadConfig(s.hidden)).eval().requires_grad_(False)
        narrow_in = torch.nn.Linear(s.hidden, 256)
        narrow = SpecDecHead(SpecDecHeadConfig(256)).eval().requires_grad_(False)
    x = torch.randn(b, s.hidden, device=device)
    fns = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        h, a, n = (copy.deepcopy(m).to(dtype) for m in (head, narrow_in, narrow))  # .to() is in place
        xd = x.to(dtype)
        fns[f"affine {name}"] = functools.partial(h.inference(), xd)
        fns[f"linear {name}"] = functools.partial(h, xd)
        fns[f"narrow linear {name}"] = functools.partial(torch.nn.Sequential(a, n), xd)
        if device.type == "cuda":
            fns[f"graphed affine {name}"] = functools.partial(RowGraphs(h.inference(), s.hidden, dtype, device), xd)
    with torch.no_grad():
        got = interleaved(fns, device, iters, repeats)
    return {k: round(1e3 * v, 1) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy sizes on CPU: checks the code, times nothing real")
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=8, help="draft steps per timed round")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--no-verify", action="store_true", help="skip the target's verification passes")
    args = ap.parse_args()
    device = torch.device("cpu") if args.tiny else torch.device("cuda", torch.cuda.current_device())  # as vLLM sets it
    s, dtype = (TINY if args.tiny else LLAMA_8B), torch.bfloat16
    iters = 2 if args.tiny else 20
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict = {"shape": asdict(s), "dtype": str(dtype), "k": args.k, "repeats": args.repeats}
    doc["torch"] = torch.__version__
    doc["device"] = "cpu (tiny check)" if args.tiny else torch.cuda.get_device_name(device)
    print(doc, flush=True)
    batches = args.batches

    # Draft steps and the loops around them, per batch size.
    head = eagle3_head(s, dtype, device)
    policies = ("fixed", "svip", "confidence", "specdecpp", "pacer")
    with tempfile.TemporaryDirectory() as tmp:
        heads = heads_dir(s, Path(tmp))
        doc["draft_step_ms"], doc["loop_ms_per_step"] = {}, {}
        for b in batches:
            loops = Loops(head, s, b, args.k, dtype, device)
            fns = {"draft step": loops.step, "vLLM loop": loops.vllm_round}
            for name in policies:
                fns[f"plugin: {name}"] = functools.partial(loops.plugin_round, make_policy(name, heads, device))
            fns["plugin: fixed, prepared after the wait"] = functools.partial(
                loops.plugin_round, make_policy("fixed", heads, device), ahead=False
            )
            got = interleaved(fns, device, max(2, 80 // args.k), args.repeats)
            doc["draft_step_ms"][b] = got.pop("draft step")
            doc["loop_ms_per_step"][b] = {n: round(ms / args.k, 4) for n, ms in got.items()}
            print(b, doc["draft_step_ms"][b], doc["loop_ms_per_step"][b], flush=True)
            del loops
    doc["specdecpp_head_us"] = {b: head_forward_us(s, device, b, 5 * iters, args.repeats) for b in (1, 32)}
    print("specdecpp head", doc["specdecpp_head_us"], flush=True)
    del head

    if args.no_verify:
        (out / "gpu_costs.json").write_text(json.dumps(doc, indent=1))
        print("json:", json.dumps(doc))  # the record, also where the file cannot be fetched
        print(f"saved {out}/gpu_costs.json")
        return
    # Verification passes of the target.
    w = target_weights(s, dtype, device)
    doc["verify_ms"] = []
    for b in batches:
        for t in (1, 2, 3, 4, 5, 9):
            cache = kv_cache(s, s.layers, b, t, dtype, device)
            tokens = torch.zeros(b, t, dtype=torch.long, device=device)
            mask = causal_tail(t, s.context, device)
            fwd = graphed(functools.partial(target_forward, w, s, cache, tokens, mask), device)
            ms = interleaved({"pass": fwd}, device, iters, args.repeats)["pass"]
            doc["verify_ms"].append([b, t, ms])
            print("verify", b, t, ms, flush=True)
            del fwd, cache
            if device.type == "cuda":
                torch.cuda.empty_cache()

    by_tokens: dict[int, list[float]] = {}
    for b, t, ms in doc["verify_ms"]:
        by_tokens.setdefault(b * t, []).append(ms)
    costs = {
        "draft_step_ms": [[b, doc["draft_step_ms"][b]] for b in batches],
        "verify_ms": [[n, round(statistics.median(v), 4)] for n, v in sorted(by_tokens.items())],
    }
    (out / "gpu_costs.json").write_text(json.dumps(doc, indent=1))
    (out / "costs.json").write_text(json.dumps(costs, indent=1))
    print(json.dumps(costs))
    print(f"saved {out}/gpu_costs.json and costs.json")


if __name__ == "__main__":
    main()
