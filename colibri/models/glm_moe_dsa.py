"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's body (MLA, interleaved RoPE, the sigmoid router
with `e_score_correction_bias`, shared experts, `mlp_layer_types`) and its sparse attention,
with two differences: the indexer rotates its keys and queries interleaved, and
`indexer_types` marks layers "shared" that run no indexer but reuse the top-k selection of the
nearest "full" layer before them (arXiv:2603.12201). indexer_types defaults as
GlmMoeDsaConfig derives it: from `index_topk_pattern` ("F"/"S" letters or a list), else from
`index_topk_freq` / `index_skip_topk_offset` (default 1 / 2: every layer full)."""

from __future__ import annotations

from typing import Any

from colibri.models.deepseek_v2 import TINY_YARN
from colibri.models.deepseek_v3 import sigmoid_router
from colibri.models.deepseek_v32 import TINY_DSA, dsa_layers
from colibri.models.family import Family
from colibri.models.spec import ModelSpec, MoESpec, base_spec, require


def indexer_types(config: dict[str, Any]) -> list[str]:
    """Per layer "full" or "shared", as GlmMoeDsaConfig.__post_init__ resolves it. Raises
    ValueError for another value, a wrong length, or a first layer that is "shared"."""
    n = require(config, "num_hidden_layers")
    types = config.get("indexer_types")
    if types is None:
        pattern = config.get("index_topk_pattern")
        if pattern is not None:
            letters = {"F": "full", "S": "shared"}
            types = [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
        else:
            freq = max(config.get("index_topk_freq", 1), 1)
            offset = config.get("index_skip_topk_offset", 2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(types, list) or len(types) < n or set(types) - {"full", "shared"}:
        raise ValueError(
            f"config field indexer_types: must list 'full' or 'shared' for each of the {n} "
            f"layers, got {types!r}"
        )
    if n and types[0] == "shared":
        raise ValueError("config field indexer_types: layer 0 is 'shared' but no layer before it")
    return list(types[:n])  # transformers reads entry i of layer i: a longer list is fine


def model_spec(config: dict[str, Any]) -> ModelSpec:
    shared = [t == "shared" for t in indexer_types(config)]
    layers = dsa_layers(config, "interleaved", shared)
    moe = MoESpec(router=sigmoid_router(config), d_ff=require(config, "moe_intermediate_size"))
    return base_spec(config, layers, moe, "glm_moe_dsa")


FAMILY = Family(
    model_type="glm_moe_dsa",
    model_spec=model_spec,
    defaults={  # GlmMoeDsaConfig (zai-org/GLM-5's shape)
        "vocab_size": 154880,
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 78,
        "num_attention_heads": 64,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 2048,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "qk_nope_head_dim": 192,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 32,
    },
    aliases={"num_local_experts": "n_routed_experts"},
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    test_configs={
        "glm_moe_dsa": TINY_DSA
        | dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            indexer_types=["full", "shared", "full"],
            # this run's greedy path reaches id 1 (GlmMoeDsaConfig's eos), which generate's
            # min_new_tokens would suppress: no eos, so both sides are plain argmax
            eos_token_id=None,
        ),
        "glm_moe_dsa_yarn_pattern": TINY_DSA
        | dict(
            num_hidden_layers=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            index_topk_pattern="FSSF",
            attention_bias=True,
            routed_scaling_factor=1.5,
            index_topk=7,
            rope_parameters=TINY_YARN | dict(mscale=1.0, mscale_all_dim=1.0),
        ),
    },
)
