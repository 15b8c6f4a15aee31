"""Gemma 4 multimodal checkpoints (Gemma4ForConditionalGeneration, model_type "gemma4"): the
language model is gemma4_text.py's, configured under `text_config` and stored under
`model.language_model.` (the output head tied to the embedding, or `lm_head.`); the vision
and audio towers and their embedders are dropped on conversion."""

from __future__ import annotations

from colibri.models.family import Family
from colibri.models.gemma4_text import DEFAULTS, EXPERTS, TINY, model_spec

FAMILY = Family(
    model_type="gemma4",
    model_spec=model_spec,
    defaults=DEFAULTS,
    num_experts_key="num_experts",
    d_ff_key="moe_intermediate_size",
    experts=EXPERTS,
    text_model_type="gemma4_text",
    text_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    test_configs={
        "gemma4": TINY
        | dict(
            top_k_experts=4,  # with 2, this seed's run flips top-1 under q8_0 (flat logits)
            pad_token_id=0,  # Gemma4Model masks multimodal tokens with it
            # Gemma4PreTrainedModel initialises with the top-level initializer_range
            outer_config=dict(initializer_range=0.05),
            # the vision tower transformers builds beside the language model (dropped)
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
                patch_size=4,
                position_embedding_size=16,
            ),
        ),
    },
)
