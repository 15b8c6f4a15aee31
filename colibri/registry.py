"""model_type -> the module that describes it (colibri/models/<model_type>.py)."""

from __future__ import annotations

import importlib
from typing import Any

from colibri.errors import StoreError
from colibri.models.spec import ModelSpec

SUPPORTED = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
)


def model_spec(config: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a config.json dict. Raises StoreError for an unsupported model_type
    or a config field that is missing or invalid."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise StoreError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED)}"
        )
    module = importlib.import_module(f"colibri.models.{model_type}")
    try:
        return module.model_spec(config)
    except (KeyError, ValueError, TypeError) as exc:
        raise StoreError(f"config of {model_type} model: {exc}") from exc
