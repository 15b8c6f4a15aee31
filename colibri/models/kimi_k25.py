"""Kimi K2.5 (Kimi_K25ForConditionalGeneration): a vision tower (`vision_tower.*`) and
projector (`mm_projector.*`) in front of the Kimi K2 language model, whose config is
`text_config` (model_type "kimi_k2" on the hub, DeepseekV3Config). colibri runs the text
part: the converter keeps the language model's tensors (`language_model.model.*` and
`language_model.lm_head.*` on the hub, `model.language_model.*` and `lm_head.*` in
transformers 5's layout) and drops the rest with a note. The output head is tied when the
text_config says so (Kimi K2: separate `lm_head`); note that transformers' Kimi_K25Config
ties on its own top-level tie_word_embeddings, default True."""

from __future__ import annotations

import dataclasses
from typing import Any

from colibri.models import deepseek_v3
from colibri.models.family import Family
from colibri.models.kimi_k2 import TINY_KIMI
from colibri.models.spec import ModelSpec


def model_spec(config: dict[str, Any]) -> ModelSpec:
    return dataclasses.replace(deepseek_v3.model_spec(config), model_type="kimi_k25")


FAMILY = Family(
    model_type="kimi_k25",
    model_spec=model_spec,
    defaults=deepseek_v3.FAMILY.defaults,  # of text_config: DeepseekV3Config
    aliases=deepseek_v3.FAMILY.aliases,
    num_experts_key="n_routed_experts",
    d_ff_key="moe_intermediate_size",
    text_model_type="deepseek_v3",
    text_prefixes=(
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
        ("lm_head.", "lm_head."),
    ),
    # the language model exported as DeepSeek-V3 (llama.cpp deepseek2; the vision tower is not)
    gguf=dataclasses.replace(deepseek_v3.FAMILY.gguf, importable=False),
    test_configs={"kimi_k25": TINY_KIMI | dict(n_group=4, topk_group=2, q_lora_rank=None)},
)
