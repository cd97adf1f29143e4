"""A tiny target with an MTP layer, for `speculative_config.method = "mtp"` on CPU.

    .venv/bin/python -m benchmarks.toy_pair.mimo_mtp OUT_DIR

The bundled toy target is a dense Qwen3 with no MTP layer, and every MTP checkpoint vLLM serves is
gigabytes. This writes, deterministically and in about a second, a 5 MB checkpoint of vLLM's MiMo
architecture (`MiMoForCausalLM`: a Qwen2 decoder, plus `num_nextn_predict_layers` MTP layers that
vLLM's `mimo_mtp` drafter loads from the same directory), with the toy target's tokenizer.

The weights are random, chosen so that the MTP layer drafts well but not perfectly: the target has
one decoder layer; the MTP layer reads only the next token's embedding (its `input_proj` selects that
half; every embedding row has RMS 1, so the layer norm in front leaves it unchanged) and runs a copy
of the target's decoder layer with its matrices perturbed by `noise` (relative). At noise 0 it
recomputes the target's next distribution from its own context, and agrees with the target's greedy
token most of the time; the noise lowers that. The language it speaks is noise: the checkpoint is a
test fixture for the MTP code path, not a model.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.paths import TARGET

NOISE = 0.15  # relative perturbation of the MTP layer's matrices: it accepts about 60% at its first position


def build(
    out: Path,
    noise: float = NOISE,
    seed: int = 0,
    hidden: int = 128,
    intermediate: int = 384,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    tokenizer_dir: Path = TARGET,
) -> Path:
    """Write the checkpoint to `out` (created); returns `out`. Same arguments, same bytes."""
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def decoder_layer() -> dict[str, torch.Tensor]:  # Qwen2: q/k/v biases, no q/k norms
        q, kv = heads * head_dim, kv_heads * head_dim
        return {
            "self_attn.q_proj.weight": normal(q, hidden, std=hidden**-0.5),
            "self_attn.q_proj.bias": normal(q, std=0.02),
            "self_attn.k_proj.weight": normal(kv, hidden, std=hidden**-0.5),
            "self_attn.k_proj.bias": normal(kv, std=0.02),
            "self_attn.v_proj.weight": normal(kv, hidden, std=hidden**-0.5),
            "self_attn.v_proj.bias": normal(kv, std=0.02),
            "self_attn.o_proj.weight": normal(hidden, q, std=q**-0.5),
            "mlp.gate_proj.weight": normal(intermediate, hidden, std=hidden**-0.5),
            "mlp.up_proj.weight": normal(intermediate, hidden, std=hidden**-0.5),
            "mlp.down_proj.weight": normal(hidden, intermediate, std=2 * intermediate**-0.5),
            "input_layernorm.weight": torch.ones(hidden),
            "post_attention_layernorm.weight": torch.ones(hidden),
        }

    embed = torch.randn(vocab, hidden, generator=gen)
    embed = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()  # [V, H], every row RMS 1
    layer = decoder_layer()
    # untied head: with tied embeddings the residual stream would make every token predict itself
    tensors = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": normal(vocab, hidden, std=4 * hidden**-0.5),
        **{f"model.layers.0.{k}": v for k, v in layer.items()},
    }
    mtp = "model.mtp_layers.0."
    for k, v in layer.items():
        tensors[mtp + k] = v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 else v.clone()
    select_token = torch.zeros(hidden, 2 * hidden)  # input_proj reads cat([hidden state, next token's embedding])
    select_token[:, hidden:] = torch.eye(hidden)
    tensors[mtp + "input_proj.weight"] = select_token
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        tensors[f"{mtp}{norm}.weight"] = torch.ones(hidden)

    config = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",  # MiMo's config is Qwen2's plus num_nextn_predict_layers
        "num_nextn_predict_layers": 1,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "max_window_layers": 1,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--noise", type=float, default=NOISE)
    args = ap.parse_args()
    print(build(args.out, args.noise))


if __name__ == "__main__":
    main()
