"""model_type -> its family (colibri/models/<model_type>.py, discovered: every module of
colibri.models that defines `FAMILY`)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import colibri.models
from colibri.errors import StoreError
from colibri.models.family import Family
from colibri.models.spec import ModelSpec


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(colibri.models.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"colibri.models.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if isinstance(fam, Family):
            if fam.model_type != info.name:
                raise ImportError(f"{module.__file__}: FAMILY.model_type {fam.model_type!r}")
            found[fam.model_type] = fam
    return found


FAMILIES: dict[str, Family] = _discover()
SUPPORTED: tuple[str, ...] = tuple(FAMILIES)


def family(model_type: Any) -> Family:
    """The Family of `model_type`. Raises StoreError naming the supported ones."""
    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is None:
        raise StoreError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED)}"
        )
    return fam


def resolve_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as colibri reads it (Family.resolve_config: text_config, aliases,
    transformers defaults for the keys left out). Raises StoreError (unsupported model_type)."""
    return family(config.get("model_type")).resolve_config(config)


def model_spec(config: dict[str, Any]) -> ModelSpec:
    """The ModelSpec of a config.json dict. Raises StoreError for an unsupported model_type
    or a config field that is missing or invalid."""
    fam = family(config.get("model_type"))
    try:
        return fam.model_spec(fam.resolve_config(config))
    except (KeyError, ValueError, TypeError) as exc:
        raise StoreError(f"config of {fam.model_type} model: {exc}") from exc


def store_spec(store: Any) -> ModelSpec:
    """The ModelSpec of an opened store's config. Raises StoreError when the manifest's
    top-level `model_type` and its config's name different families (a hand-edited or
    mixed-up manifest: the engine reads the config, the GGUF export the top level)."""
    top, inner = store.model_type, store.config.get("model_type")
    if inner is None:  # a config without its model_type: the manifest's names the family
        return model_spec({**store.config, "model_type": top})
    if family(top) is not family(inner):
        raise StoreError(
            f"{store.path}/manifest.json: model_type {top!r} but config.model_type {inner!r}: "
            f"the two must name the same family"
        )
    return model_spec(store.config)
