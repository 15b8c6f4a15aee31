#!/usr/bin/env python
"""Write a store of random weights in the exact shape of a real MoE model, for benchmarks.

No float pass: weights are random blocks of the store type (random nibbles / int8s / e4m3
bytes) whose scale fields are set to sane values (SCALES: f16 scales small enough that every
weight is finite and |w| stays below ~0.4, the K-quants' and q4_1 / q5_1's minimums so the
weights centre on zero, MXFP4's E8M0 exponents, FP8's f32 block scales with no NaN code).
Records are slices of one random pool taken at random block-aligned offsets, so writing runs
at disk speed; each record still gets its own xxh3. Real tokenizers come from
../shared/data/tokenizers when present.

    python tools/synth_store.py qwen3-30b-a3b /tmp/stores/qwen3-30b-a3b-q4_0
    python tools/synth_store.py mixtral-8x7b OUT --layers 4 --quant q8_0
    python tools/synth_store.py deepseek-v3 OUT --scale 0.125      # 32 of 256 experts
    python tools/synth_store.py glm-5 OUT --layers 5 --scale 0.125 --dense-quant q4_0
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from colibri import registry  # noqa: E402
from colibri.convert import dense_qtype  # noqa: E402
from colibri.io.format import (  # noqa: E402
    BLOCK_QTYPES,
    FP8_BLOCK,
    QTYPES,
    ExpertLayout,
    StoreWriter,
    dense_dtype_shape,
    row_nbytes,
    tensor_nbytes,
)
from colibri.models.spec import dense_tensors as spec_dense_tensors  # noqa: E402
from colibri.models.spec import f32_tensors  # noqa: E402

TOKENIZERS = ROOT.parent / "shared" / "data" / "tokenizers"
# OLMoE-1B-7B's real per-expert routing counts (top-8 of 64) at layers 0, 7 and 15 over ~209K
# tokens per text domain (shared/data/SOURCES.md, routing/olmoe_repo_stats)
ROUTING_STATS = ROOT.parent / "shared" / "data" / "routing" / "olmoe_repo_stats" / "olmoe"
ROUTING_DOMAINS = ("arxiv", "book", "c4", "github", "wikipedia")
ROUTING_LAYERS = (0, 7, 15)  # the layers the counts are of, out of OLMoE's 16

MODELS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "router_aux_loss_coef": 0.02,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # zai-org/GLM-4.7-Flash (transformers' Glm4MoeLiteConfig defaults are this model's)
    "glm-4.7-flash": {
        "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
        "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
        "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
        "num_key_value_heads": 20, "n_shared_experts": 1, "n_routed_experts": 64,
        "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 4, "norm_topk_prob": True,
        "mlp_layer_types": ["dense"] + ["sparse"] * 46, "hidden_act": "silu",
        "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "rope_interleave": True, "attention_bias": False, "tie_word_embeddings": False,
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304,
        "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "clip_qkv": None, "attention_bias": False, "tie_word_embeddings": False,
        "eos_token_id": 50279, "pad_token_id": 1,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 0,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    },
    # zai-org/GLM-5's shape (GlmMoeDsaConfig's defaults): MLA + the DSA indexer, 744B
    "glm-5": {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048,
        "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 32, "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    },
    # DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash's config.json: DeepseekV4Config's
    # defaults for the body, its own compress_ratios: two sliding-window layers, then CSA /
    # HCA alternating to a CSA layer 42, the 44th entry (0) the MTP layer's; YaRN on the
    # compressed layers; three hash-routed layers first. --layers 4: sliding, sliding, CSA, HCA)
    "deepseek-v4-flash": {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6, "n_routed_experts": 256,
        "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
        "max_position_embeddings": 1048576, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8,
        "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "partial_rotary_factor": 0.125, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "compress_ratios": [0, 0, *[4, 128] * 20, 4, 0], "num_hash_layers": 3,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    },
    # deepseek-ai/DeepSeek-V3.2's shape: DeepSeek-V3 + the DSA indexer (64 heads)
    "deepseek-v3.2": {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096},
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    },
    "minimax-m2": {  # MiniMaxAI/MiniMax-M2
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536,
        "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
        "head_dim": 128, "rotary_dim": 64, "rope_theta": 5000000, "num_local_experts": 256,
        "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True,
        "use_qk_norm": True, "qk_norm_type": "per_layer", "hidden_act": "silu",
        "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "bos_token_id": 200019, "eos_token_id": 200020,
    },
    "llama-4-scout": {  # meta-llama/Llama-4-Scout-17B-16E-Instruct (vision tower not stored)
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120,
            "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1, "use_qk_norm": True, "attention_chunk_size": 8192,
            "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
            "rope_theta": 500000.0, "rope_scaling": {
                "rope_type": "llama3", "factor": 16.0, "high_freq_factor": 1.0,
                "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
            "max_position_embeddings": 10485760, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "tie_word_embeddings": False, "bos_token_id": 200000,
            "eos_token_id": [200001, 200007, 200008],
        },
        "vision_config": {"model_type": "llama4_vision_model"},
    },
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # Qwen3.5-397B-A17B: multimodal; the language model is text_config (the vision tower is
    # not part of a store). 15 x (3 Gated DeltaNet + 1 gated attention) layers, all MoE.
    "qwen3.5-397b-a17b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False, "image_token_id": 248056, "video_token_id": 248057,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 4096,
            "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 2,
            "head_dim": 256, "full_attention_interval": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # x 15, see below
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 64, "num_experts": 512, "num_experts_per_tok": 10,
            "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
            "hidden_act": "silu", "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
            "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 248044,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                "mrope_interleaved": True},
        },
    },
    # google/gemma-4-26B-A4B: multimodal (Gemma4ForConditionalGeneration); the language model
    # is text_config (vision tower not stored). Values as published in its text_config (the
    # hub config.json, quoted verbatim by the mlx-community/gemma-4-26b-a4b-it-4bit conversion
    # and by other engines' tests): 30 layers, 5 sliding (window 1024) to 1 full, full layers
    # with head_dim 512, 2 kv heads and K = V; 128 experts of 704, top-8, beside a 2112-wide
    # dense GELU MLP; no per-layer inputs, no KV sharing; logits soft-capped at 30.
    # bos / eos / pad are Gemma's usual ids (2 / 1 / 0), the hub's eos list [1, 106] cut to 1.
    "gemma-4-26b-a4b": {
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2816,
            "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
            "num_global_key_value_heads": 2, "attention_k_eq_v": True, "sliding_window": 1024,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],  # x 5, see below
            "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
            "moe_intermediate_size": 704, "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 0,
            "use_double_wide_mlp": False, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": True,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0},
            },
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        },
    },
}  # fmt: skip
MODELS["qwen3.5-397b-a17b"]["text_config"]["layer_types"] *= 15
MODELS["gemma-4-26b-a4b"]["text_config"]["layer_types"] *= 5
# model -> [(file in TOKENIZERS, name in the store)]; .xz is decompressed, .model converted
TOKENIZER_SOURCES = {
    "mixtral-8x7b": [("mixtral_mistral/tokenizer.model.v1", "tokenizer.json")],
    "qwen3-30b-a3b": [
        ("qwen/qwen3_tokenizer.json.xz", "tokenizer.json"),
        ("qwen/qwen3_tokenizer_config.json", "tokenizer_config.json"),
    ],
    "olmoe-1b-7b": [("olmoe/allenai_gpt-neox-olmo-dolma-v1_5.json", "tokenizer.json")],
    # Qwen3-Next ships the Qwen3 tokenizer; Qwen3.5's own (248k ids) is not in shared data, so
    # its synthetic store gets the Qwen3 one (ids < 151669, all inside its vocabulary)
    "qwen3-next-80b-a3b": [
        ("qwen/qwen3_tokenizer.json.xz", "tokenizer.json"),
        ("qwen/qwen3_tokenizer_config.json", "tokenizer_config.json"),
    ],
    "qwen3.5-397b-a17b": [
        ("qwen/qwen3_tokenizer.json.xz", "tokenizer.json"),
        ("qwen/qwen3_tokenizer_config.json", "tokenizer_config.json"),
    ],
    # no GLM tokenizer in shared/data: Qwen3's (151k ids of the 154880) stands in
    "glm-4.7-flash": [("qwen/qwen3_tokenizer.json.xz", "tokenizer.json")],
    "deepseek-v3": [
        ("deepseek_v3/tokenizer.json.xz", "tokenizer.json"),
        ("deepseek_v3/tokenizer_config.json", "tokenizer_config.json"),
    ],
    # V3.2 keeps V3's vocabulary; GLM-5's tokenizer is not in shared/data: DeepSeek-V3's
    # (129280 ids < 154880) stands in so text prompts work on the synthetic store
    "deepseek-v3.2": [
        ("deepseek_v3/tokenizer.json.xz", "tokenizer.json"),
        ("deepseek_v3/tokenizer_config.json", "tokenizer_config.json"),
    ],
    # V4 keeps DeepSeek-V3's vocabulary size; V3's tokenizer stands in
    "deepseek-v4-flash": [
        ("deepseek_v3/tokenizer.json.xz", "tokenizer.json"),
        ("deepseek_v3/tokenizer_config.json", "tokenizer_config.json"),
    ],
    "glm-5": [
        ("deepseek_v3/tokenizer.json.xz", "tokenizer.json"),
        ("deepseek_v3/tokenizer_config.json", "tokenizer_config.json"),
    ],
    # stand-ins: shared/data has neither model's own tokenizer; Qwen3's ids (< 151669) are
    # inside both vocabularies, so text goes in and out (the weights are random anyway)
    "minimax-m2": [("qwen/qwen3_tokenizer.json.xz", "tokenizer.json")],
    "llama-4-scout": [("qwen/qwen3_tokenizer.json.xz", "tokenizer.json")],
    # no Gemma tokenizer in shared/data: Qwen3's ids (< 151669 of 262144) stand in
    "gemma-4-26b-a4b": [("qwen/qwen3_tokenizer.json.xz", "tokenizer.json")],
}


def model_config(model: str, layers: int | None = None, scale: float = 1.0) -> dict[str, Any]:
    """The HF config of `model`, with `layers` layers and the routed experts scaled by
    `scale` (at least top-k experts, a multiple of n_group for DeepSeek)."""
    outer = json.loads(json.dumps(MODELS[model]))
    fam = registry.family(outer["model_type"])
    cfg = outer["text_config"] if fam.text_model_type else outer  # multimodal: the LM part
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:  # hybrids keep their pattern's first `layers` layers
            cfg["layer_types"] = cfg["layer_types"][:layers]
        if "mlp_layer_types" in cfg:
            cfg["mlp_layer_types"] = cfg["mlp_layer_types"][:layers]
        if "compress_ratios" in cfg:  # DeepSeek-V4's per-layer pattern
            cfg["compress_ratios"] = cfg["compress_ratios"][:layers]
    if scale != 1.0:
        keys = [
            fam.num_experts_key,
            *(a for a, k in fam.aliases.items() if k == fam.num_experts_key),
        ]
        key = next(k for k in keys if k in cfg)
        mult = cfg.get("n_group", 1)
        top_k = registry.model_spec(outer).moe.router.top_k  # num_experts_per_tok, ...
        n = max(top_k, round(cfg[key] * scale / mult) * mult)
        cfg[key] = max(n, mult)
    return outer


def expert_shape(cfg: dict[str, Any]) -> tuple[int, int, list[int]]:
    """(num_experts, d_ff, MoE layer ids) of `cfg`, from its family's spec."""
    spec = registry.model_spec(cfg)
    moe = [layer.index for layer in spec.layers if layer.moe]
    return spec.moe.router.num_experts, spec.moe.d_ff, moe


def dense_tensors(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every dense tensor's HF name and shape for `cfg` (any supported family), layer by
    layer, as the family's spec says (colibri.models.spec.dense_tensors)."""
    return list(spec_dense_tensors(registry.model_spec(cfg)).items())


# qtype -> the scale fields of one block: (byte offset, kind, a, b). "f16": an f16 drawn
# uniformly in [a, b]; "min": an f16 equal to a times the block's first f16 scale d (q4_1 / q5_1
# m = -7.5 d / -15.5 d, the K-quants' dmin = mean level x mean scale / mean min, so the weights
# centre on zero); "e8m0": a byte drawn from [a, b) (MXFP4: w = level * 2^(e - 128)). The rest
# of the block (levels, 6-bit sub-scales, high bits) is random: every bit pattern is valid.
# The ranges bound |w| by ~0.02 (q4_0) to ~0.4 (q8_0, worst-case sub-scales).
SCALES: dict[str, list[tuple[int, str, float, float]]] = {
    "q4_0": [(0, "f16", 5e-4, 3e-3)],
    "q4_1": [(0, "f16", 5e-4, 3e-3), (2, "min", -7.5, 0)],
    "q5_0": [(0, "f16", 5e-4, 3e-3)],
    "q5_1": [(0, "f16", 3e-4, 1.5e-3), (2, "min", -15.5, 0)],
    "q8_0": [(0, "f16", 5e-4, 3e-3)],
    "q2_k": [(80, "f16", 2e-4, 1e-3), (82, "min", 1.5, 0)],  # w = d sc q - dmin m, q 0..3
    "q3_k": [(108, "f16", 2e-4, 1e-3)],  # 6-bit signed sub-scales, q -4..3
    "q4_k": [(0, "f16", 2e-5, 1e-4), (2, "min", 7.5, 0)],  # 6-bit sc / m, q 0..15
    "q5_k": [(0, "f16", 1e-5, 5e-5), (2, "min", 15.5, 0)],  # q 0..31
    "q6_k": [(208, "f16", 5e-6, 3e-5)],  # int8 sub-scales, q -32..31
    "iq4_nl": [(0, "f16", 5e-5, 2e-4)],  # levels up to 127
    "iq4_xs": [(0, "f16", 2e-6, 1e-5)],  # 6-bit signed sub-scales x levels up to 127
    "mxfp4": [(0, "e8m0", 115, 121)],  # levels up to 12
}
FP8_SCALE = (2e-5, 1e-4)  # fp8 block scales: e4m3 values up to 448 -> |w| < 0.045


def random_rows(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_nbytes(qtype, cols)]: valid random rows of block type `qtype` with the
    scale fields of SCALES (fp8: each row's ceil(cols / 128) f32 scales from FP8_SCALE, then
    e4m3 bytes without the NaN codes 0x7f / 0xff)."""
    if qtype == "fp8":
        ns = -(-cols // FP8_BLOCK)
        sc = rng.uniform(*FP8_SCALE, (rows, ns)).astype(np.float32).view(np.uint8)
        v = np.frombuffer(rng.bytes(rows * cols), np.uint8).reshape(rows, cols).copy()
        v[(v & 0x7F) == 0x7F] ^= 1  # 0x7f -> 0x7e: the largest finite code, not NaN
        return np.concatenate([sc, v], axis=1)
    bw, bsz = QTYPES[qtype]
    nb = rows * (cols // bw)
    blocks = np.frombuffer(rng.bytes(nb * bsz), np.uint8).reshape(nb, bsz).copy()
    d = None
    for off, kind, a, b in SCALES[qtype]:
        if kind == "f16":
            d = rng.uniform(a, b, nb).astype(np.float16)
            blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
        elif kind == "min":
            assert d is not None
            blocks[:, off : off + 2] = (a * d).astype(np.float16).view(np.uint8).reshape(-1, 2)
        else:  # e8m0
            blocks[:, off] = rng.integers(int(a), int(b), nb)
    return blocks.reshape(rows, -1)


class BlockPool:
    """About `nbytes` of valid random `qtype` rows of `cols` weights (random_rows); `take(n)`
    returns n bytes starting at a random row boundary (n need not be whole rows: a block
    type's rows are whole blocks, so any block boundary reads as valid blocks)."""

    def __init__(self, qtype: str, nbytes: int, rng: np.random.Generator, cols: int) -> None:
        self.unit = row_nbytes(qtype, cols)
        nrows = nbytes // self.unit + 1
        self.data = random_rows(qtype, nrows, cols, rng).reshape(-1)
        self.rng, self.nrows = rng, nrows

    def take(self, n: int) -> memoryview:
        need = -(-n // self.unit)
        if need > self.nrows:
            raise ValueError(f"pool of {self.nrows} rows cannot give {need}")
        start = int(self.rng.integers(0, self.nrows - need + 1)) * self.unit
        return memoryview(self.data[start : start + n])


def _float_tensor(
    name: str, shape: tuple[int, ...], rng: np.random.Generator, n_experts: int = 1
) -> np.ndarray:
    if name.endswith(".tid2eid"):  # DeepSeek-V4 hash routing: top_k distinct ids per token
        vocab, k = shape
        first = rng.integers(0, n_experts, (vocab, 1))
        return ((first + np.arange(k) * max(1, n_experts // k)) % n_experts).astype(np.float32)
    if name.endswith("norm.weight"):
        return (1 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(("bias", "e_score_correction_bias")):
        return np.zeros(shape, np.float32)
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)


def routing_popularity(domain: str, num_layers: int) -> np.ndarray:
    """f64 [num_layers, 64]: per store layer, the share of tokens routed to each expert (rows
    sum to top-k = 8) in OLMoE-1B-7B's real routing counts of text domain `domain`, store layer
    i taking the counted layer (0, 7, 15) nearest its relative depth in OLMoE's 16. Raises
    SystemExit naming the file when the statistics are absent or the domain unknown."""
    import gzip

    if domain not in ROUTING_DOMAINS:
        raise SystemExit(f"--routing {domain}: must be one of {', '.join(ROUTING_DOMAINS)}")
    path = ROUTING_STATS / "expert_counts" / f"{domain}.json.gz"
    if not path.is_file():
        raise SystemExit(f"--routing {domain}: routing statistics {path} not found")
    with gzip.open(path) as f:
        counts = json.loads(f.read())  # one {expert id: count} per counted layer
    shares = []
    for c in counts:
        n = np.array([c.get(str(e), 0) for e in range(64)], dtype=np.float64) + 1.0
        shares.append(8.0 * n / n.sum())
    out = np.empty((num_layers, 64))
    for i in range(num_layers):
        depth = 15.0 * i / max(1, num_layers - 1)
        out[i] = shares[min(range(3), key=lambda j: abs(ROUTING_LAYERS[j] - depth))]
    return out


# --routing: block 0 of every embedding row is one constant (scale ROUTING_D, all quants 127),
# a direction every token's hidden state shares; each router's columns over that block then
# act as per-expert logit offsets, calibrated so top-k picks reproduce the real popularity
ROUTING_D = 3e-3


def routed_embedding_rows(rows: np.ndarray) -> np.ndarray:
    """uint8 [n, row_nbytes] Q8_0 embedding rows with block 0 set to the shared constant."""
    rows = rows.copy()
    rows[:, 0:2] = np.frombuffer(np.float16(ROUTING_D).tobytes(), np.uint8)
    rows[:, 2:34] = 127
    return rows


def calibrate_router(
    w: np.ndarray, h: np.ndarray, share: np.ndarray, top_k: int, iters: int = 200
) -> tuple[np.ndarray, float]:
    """Set router `w` (f32 [E, d], modified in place) columns 0..31 so that on hidden states
    `h` (f32 [n, d], block 0 the shared constant) the top-k picks reproduce `share` (f64 [E],
    the share of tokens routed to each expert). Returns (w, the mean absolute error of the
    achieved shares, in shares)."""
    w[:, :32] = 0.0
    noise = h @ w.T  # [n, E] the logits without block 0's columns
    c = float(h[:, :32].sum(axis=1).mean())  # h's component along block 0
    along = (h[:, :32].sum(axis=1) / c)[:, None]  # [n, 1] each token's share of it (~1)
    target = np.clip(share, 1e-4, 0.999)
    b = np.log(target)
    got = target
    for _ in range(iters):
        top = np.argpartition(-(noise + along * b), top_k - 1, axis=1)[:, :top_k]
        got = np.bincount(top.ravel(), minlength=len(share)) / len(h)
        b += 0.3 * (np.log(target) - np.log(np.maximum(got, 0.5 / len(h))))
        b -= b.mean()
    w[:, :32] = (b / c)[:, None]
    return w, float(np.abs(got - share).mean())


def _tokenizer_files(model: str) -> list[tuple[str, bytes]]:
    files = []
    for rel, name in TOKENIZER_SOURCES.get(model, []):
        path = TOKENIZERS / rel
        if not path.is_file():
            print(f"note: {path} absent; store gets no {name}", file=sys.stderr)
            continue
        if rel.endswith(".xz"):
            files.append((name, lzma.decompress(path.read_bytes())))
        elif ".model" in rel:
            from colibri.convert.hf import spm_to_tokenizer_json

            files.append((name, spm_to_tokenizer_json(path)))
        else:
            files.append((name, path.read_bytes()))
    return files


def synth_store(
    model: str,
    out: Path,
    *,
    quant: str = "q4_0",
    dense_quant: str = "q8_0",
    layers: int | None = None,
    scale: float = 1.0,
    seed: int = 0,
    force: bool = False,
    show_progress: bool = True,
    routing: str | None = None,
) -> Path:
    """Write a random store shaped like `model` (a key of MODELS) to `out`; returns `out`.
    routing: None (random routers: each token's experts nearly uniform) or an OLMoE text
    domain (ROUTING_DOMAINS, olmoe-1b-7b only): the routers reproduce that domain's real
    per-layer expert popularity (routing_popularity, calibrate_router). Raises SystemExit if
    the disk lacks room (store size + 1 GiB) or routing does not apply."""
    if quant not in BLOCK_QTYPES or dense_quant not in BLOCK_QTYPES:
        raise SystemExit(f"quant types must be one of {BLOCK_QTYPES}")
    cfg = model_config(model, layers, scale)
    E, d_ff, moe = expert_shape(cfg)
    popularity = None
    if routing is not None:
        if model != "olmoe-1b-7b" or E != 64 or dense_quant != "q8_0":
            raise SystemExit("--routing: the statistics are OLMoE-1B-7B's (64 experts, top-8): "
                             "model olmoe-1b-7b, --scale 1, --dense-quant q8_0 only")  # fmt: skip
        popularity = routing_popularity(routing, cfg["num_hidden_layers"])
    floats: dict[str, np.ndarray] = {}
    h_sample: np.ndarray | None = None  # f32 [n, d] embedding rows (the router input's source)
    fit: list[float] = []
    layout = ExpertLayout.build(quant, registry.model_spec(cfg).d_model, d_ff)
    f32 = f32_tensors(registry.model_spec(cfg))
    plan = [(n, dense_qtype(n, s, dense_quant, f32), s) for n, s in dense_tensors(cfg)]
    dense_nbytes = sum(tensor_nbytes(q, s) for _, q, s in plan)
    total = dense_nbytes + len(moe) * E * layout.record_nbytes
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total + (1 << 30):
        raise SystemExit(
            f"{out.parent}: {free / 2**30:.1f} GiB free, the store needs {total / 2**30:.1f} GiB"
            " (+1 GiB margin); try --layers or --scale"
        )
    rng = np.random.default_rng(seed)
    biggest = max(max(t.nbytes for t in layout.tensors.values()), 1 << 20)
    pools: dict[tuple[str, int], BlockPool] = {}

    def pool(qtype: str, cols: int) -> BlockPool:
        """One pool per type and row length (an fp8 row holds its own scales); block types
        share one pool of 256-column rows, taken at any block boundary."""
        key = (qtype, cols if qtype == "fp8" else 0)
        if key not in pools:
            pools[key] = BlockPool(qtype, max(64 << 20, 2 * biggest), rng, key[1] or 256)
        return pools[key]

    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=model,
               disable=not show_progress)  # fmt: skip
    # with routing, the store is calibrated under a temporary name and renamed last, so a
    # store at `out` is always complete (ensure_store relies on that)
    target = out.parent / f".{out.name}.calibrating" if popularity is not None else out
    if popularity is not None and out.exists() and not force:
        raise SystemExit(f"{out} exists (--force replaces it)")
    with StoreWriter(target, layout, force=True if popularity is not None else force) as w:
        w.begin_dense(plan)
        for name, qtype, shape in plan:
            _, stored = dense_dtype_shape(qtype, shape)
            if qtype in BLOCK_QTYPES:
                rows, rb = stored
                step = max(1, (32 << 20) // rb)
                src = pool(qtype, shape[-1])
                for r in range(0, rows, step):
                    chunk = src.take(min(step, rows - r) * rb)
                    if popularity is not None and name == "model.embed_tokens.weight":
                        q = routed_embedding_rows(np.frombuffer(chunk, np.uint8).reshape(-1, rb))
                        chunk = memoryview(q.reshape(-1))
                        if h_sample is None:
                            h_sample = _dequant_q8_0(q[:2048], shape[-1])
                    w.write_dense(name, chunk)
            else:
                t = _float_tensor(name, shape, rng, E)
                floats[name] = t
                layer = name.split(".")[2] if name.startswith("model.layers.") else None
                if popularity is not None and name.endswith(".mlp.gate.weight"):
                    assert h_sample is not None  # the embedding comes first
                    g = floats[f"model.layers.{layer}.post_attention_layernorm.weight"]
                    h = h_sample / np.sqrt((h_sample**2).mean(axis=1, keepdims=True) + 1e-5) * g
                    t, err = calibrate_router(t, h, popularity[int(layer)], 8)
                    fit.append(err)
                w.write_dense(name, t)
            bar.update(tensor_nbytes(qtype, shape))
        srcs = {k: pool(t.qtype, t.shape[-1]) for k, t in layout.tensors.items()}
        for layer in moe:
            for e in range(E):
                w.write_expert(
                    layer, e, {k: srcs[k].take(t.nbytes) for k, t in layout.tensors.items()}
                )
                bar.update(layout.record_nbytes)
        for name, data in _tokenizer_files(model):
            w.add_file(name, data)
        source = {"kind": "synthetic", "name": model, "seed": seed, "scale": scale}
        if routing is not None:
            source["routing"] = {"olmoe_domain": routing, "calibration_mae": fit}
        path = w.finish(cfg["model_type"], cfg, source)
    bar.close()
    if popularity is not None:
        recalibrate_routing(path, popularity)
        if out.exists():
            shutil.rmtree(out)
        path = path.rename(out)
    return path


def recalibrate_routing(out: Path, popularity: np.ndarray, rounds: int = 2) -> list[float]:
    """Calibrate the routers of the store at `out` on the hidden states the engine really
    feeds them (attention and earlier layers move them off the embedding-only estimate):
    `rounds` times, layer by layer, prefill 24 random 48-token prompts (every expert in RAM),
    capture each router's input, re-solve calibrate_router on it and patch the router tensor
    in place (dense.safetensors and its xxh3 in the manifest). Returns per MoE layer the
    mean absolute error of the achieved shares on the last capture."""
    import asyncio

    import xxhash

    from colibri.engine import open_engine

    manifest = json.loads((out / "manifest.json").read_text())
    dense = out / manifest["dense_file"]
    with open(dense, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(hlen))
    vocab = manifest["config"]["vocab_size"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, vocab - 5, 48).tolist() for _ in range(24)]
    errors: dict[int, float] = {}
    fit: list[float] = []

    async def capture() -> dict[int, list[np.ndarray]]:
        hs: dict[int, list[np.ndarray]] = {}
        async with open_engine(out, n_ctx=64, threads=0, prefetch=False) as eng:
            route = eng.model.route

            def spy(i: int, h: np.ndarray, *a: Any, **k: Any) -> Any:
                hs.setdefault(i, []).append(np.array(h, dtype=np.float32))
                return route(i, h, *a, **k)

            eng.model.route = spy  # type: ignore[method-assign]
            for p in prompts:
                seq = eng.new_sequence()
                await eng.pipeline.forward(np.asarray(p, dtype=np.int64), seq.kv)
        return hs

    layers = [int(n.split(".")[2]) for n in header if n.endswith(".mlp.gate.weight")]
    for _ in range(rounds):
        for layer in sorted(layers):
            hs = asyncio.run(capture())
            h = np.concatenate(hs[layer])
            name = f"model.layers.{layer}.mlp.gate.weight"
            a, b = header[name]["data_offsets"]
            with open(dense, "r+b") as f:
                f.seek(8 + hlen + a)
                w = np.frombuffer(f.read(b - a), np.float32).reshape(header[name]["shape"]).copy()
                w, errors[layer] = calibrate_router(w, h, popularity[layer], 8)
                f.seek(8 + hlen + a)
                f.write(w.tobytes())
            manifest["dense"][name]["xxh3"] = f"{xxhash.xxh3_64_intdigest(w.tobytes()):016x}"
            fit = [errors[i] for i in sorted(errors)]
            manifest["source"]["routing"]["calibration_mae"] = fit  # on the engine's states
            (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return fit


def _dequant_q8_0(rows: np.ndarray, cols: int) -> np.ndarray:
    """f32 [n, cols] of uint8 [n, row_nbytes] Q8_0 rows (34-byte blocks: f16 scale, 32 int8)."""
    b = rows.reshape(len(rows), cols // 32, 34)
    d = b[:, :, :2].copy().view(np.float16).astype(np.float32)  # [n, blocks, 1]
    return (d * b[:, :, 2:].view(np.int8).astype(np.float32)).reshape(len(rows), cols)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--quant", default="q4_0", choices=BLOCK_QTYPES, help="expert weights")
    ap.add_argument("--dense-quant", default="q8_0", choices=BLOCK_QTYPES)
    ap.add_argument("--layers", type=int, help="number of layers (default: the model's)")
    ap.add_argument(
        "--scale", type=float, default=None,
        help="fraction of routed experts kept (default 1; deepseek-v3: 0.125)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace an existing OUT")
    ap.add_argument(
        "--routing", choices=ROUTING_DOMAINS,
        help="olmoe-1b-7b: routers reproducing OLMoE's real per-layer expert popularity on "
        "this text domain (default: random routers)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    scale = (
        args.scale
        if args.scale is not None
        else (0.125 if args.model in ("deepseek-v3", "deepseek-v3.2", "glm-5") else 1)
    )
    t0 = time.perf_counter()
    path = synth_store(
        args.model, args.out, quant=args.quant, dense_quant=args.dense_quant,
        layers=args.layers, scale=scale, seed=args.seed, force=args.force, routing=args.routing,
    )  # fmt: skip
    size = sum(f.stat().st_size for f in path.iterdir())
    dt = time.perf_counter() - t0
    print(f"wrote {path}: {size / 1e9:.2f} GB in {dt:.1f} s ({size / 1e9 / dt:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
