"""Tiny random Hugging Face MoE models, built with transformers in the test itself.

The default init hides bugs (norms all 1, biases 0, router gaps ~1e-4), so norms and biases
are perturbed and `initializer_range` raised. `router_gap()` tells how close a run came to a
routing tie, so tests can skip prompts whose expert choice is numerically ambiguous.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

torch = __import__("pytest").importorskip("torch")
transformers = __import__("pytest").importorskip("transformers")

torch.set_num_threads(1)

COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    tie_word_embeddings=False,
)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": (
        "MixtralConfig",
        dict(intermediate_size=96, num_local_experts=6, num_experts_per_tok=2, rope_theta=1e4),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            qkv_bias=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2, clip_qkv=8.0),
    ),
}


def build(model_type: str, seed: int = 0) -> Any:
    """A tiny random *ForCausalLM of `model_type` in f32 eval mode, norms and biases perturbed."""
    cls_name, extra = CONFIGS[model_type]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def save(model: Any, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def router_gap(model: Any, ids: list[int]) -> float:
    """Smallest gap, over layers and tokens, between the k-th and (k+1)-th router probability
    (and between the two largest logits of the output), on the sequence `ids`."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    cfg = model.config
    k = cfg.num_experts_per_tok
    gap = float("inf")
    for logits in out.router_logits or ():
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1).values
        gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
    top2 = torch.topk(out.logits[0].float(), 2, dim=-1).values
    return min(gap, float((top2[:, 0] - top2[:, 1]).min()))


def reference_logits(model: Any, ids: list[int]) -> np.ndarray:
    """f32 [len(ids), vocab] logits of the full sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(ids) :].tolist()
