"""Llama 4 Scout / Maverick checkpoints (Llama4ForConditionalGeneration, model_type "llama4"):
the language model is llama4_text.py's, configured under `text_config` and stored under
`language_model.model.` / `language_model.lm_head.` (the hub files and transformers 5's
save_pretrained alike); the vision tower and projector are dropped on conversion."""

from __future__ import annotations

from colibri.models.family import Family
from colibri.models.llama4_text import DEFAULTS, EXPERTS, model_spec

FAMILY = Family(
    model_type="llama4",
    model_spec=model_spec,
    defaults=DEFAULTS,
    num_experts_key="num_local_experts",
    d_ff_key="intermediate_size",
    experts=EXPERTS,
    text_model_type="llama4_text",
    text_prefixes=(
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),  # in case a later transformers moves it
    ),
)
