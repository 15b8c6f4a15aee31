"""What a family file declares besides its ModelSpec: the one record the converter, the GGUF
exporter / importer, the synthetic-store tool and the tests derive from.

A family file `colibri/models/<model_type>.py` defines `FAMILY = Family(...)`; the registry
discovers every module of this package that has one. Everything here is data plus pure
functions of a config.json dict: no engine, pipeline, io reader or converter is imported.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from colibri.models.spec import ModelSpec


@dataclass(frozen=True)
class ExpertNames:
    """Where a checkpoint keeps the routed experts of layer L (tensor names as saved).

    per_expert: the hub ("original") layout, one tensor per expert and projection, a format
    string with {layer}, {expert}, {proj}; projs names gate / up / down's {proj}. None when the
    family has no such layout (gpt-oss). fused: transformers 5's layout, a format string with
    {layer} naming the prefix of `gate_up_proj` and `down_proj` (and `*_bias`), stacked over
    experts: "concat" is [E, 2*I, H] gate rows then up rows and [E, H, I]; "interleaved_t" is
    gpt-oss's [E, H, 2*I] with gate = [..., ::2], up = [..., 1::2] and [E, I, H], with biases
    gate_up_proj_bias [E, 2*I] (same interleave) and down_proj_bias [E, H]; "concat_t" is
    Llama 4's [E, H, 2*I] with gate = [..., :I], up = [..., I:] and down_proj [E, I, H].
    """

    per_expert: str | None = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
    projs: dict[str, str] = field(
        default_factory=lambda: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    )
    fused: str = "model.layers.{layer}.mlp.experts"
    fused_layout: Literal["concat", "interleaved_t", "concat_t"] = "concat"

    @property
    def biases(self) -> bool:
        """Whether the experts have biases (then records hold gate/up/down_bias, f32)."""
        return self.fused_layout == "interleaved_t"


@dataclass(frozen=True)
class GGUFArch:
    """The llama.cpp architecture a family maps to (export and import).

    arch: gguf.MODEL_ARCH member name ("LLAMA"); name: its `general.architecture` string.
    architectures: the HF `architectures` entry written into an imported config.
    rope_permute: llama.cpp rotates adjacent pairs where HF rotates halves, so q/k rows are
    permuted head by head (convert_hf_to_gguf.py LlamaModel.permute).
    expert_ff_key: the GGUF key holding the experts' d_ff ("feed_forward_length" or
    "expert_feed_forward_length"); implied: config values llama.cpp's arch assumes (the
    exporter refuses a store whose resolved config differs; the importer writes them);
    requires_mha: the arch has no grouped-query attention (num_key_value_heads must equal
    num_attention_heads to export). shared_ff_key: the GGUF key of the shared expert's d_ff
    (config `shared_expert_intermediate_size`), for archs with one.
    hparams: GGUF key (after "<arch>.") -> config field, written from the resolved config
    and read back into it (int as uint32, float as float32, bool as bool; a field the config
    leaves None is not written); "leading_dense_block_count" among them says the arch runs
    its first that many layers dense (first_k_dense_replace) and every later one MoE.
    fixed: GGUF keys of one value for the family (expert_gating_func 2 = sigmoid); on import
    the first family of an architecture whose fixed values the file has is chosen.
    leading_dense: the arch runs its first `leading_dense_block_count` layers as dense MLPs
    and every later one as MoE (config first_k_dense_replace on import).
    mla: multi-head latent attention as llama.cpp's deepseek2 runs it without absorption
    (attn_kv_b kept whole, keys and values expanded per head: key_length = qk_nope + qk_rope,
    value_length = v_head_dim, head_count_kv = head_count; convert_hf_to_gguf's split into
    attn_k_b / attn_v_b would change the stored bytes).
    importable: GGUF import may pick this family (False for aliases of another, e.g. Kimi K2
    of DeepSeek-V3).
    expert_biases: the arch has `blk.N.ffn_{gate,up,down}_exps.bias` (gpt-oss; f32 [E, rows]).
    swa_pattern: the arch runs sliding-window attention (`attention.sliding_window`) on the
    layers i with i % swa_pattern < swa_pattern - 1 and full attention on the others
    (llama.cpp's set_swa_pattern; 0: no sliding window).
    partial_rotary: the arch's `rope.dimension_count` is the rotated dims of each head (the
    spec's rot_dim), imported as `partial_rotary_factor`. present: config field -> a layer-0
    GGUF tensor name whose presence sets it true on import (biases, q/k norms the arch may or
    may not have).
    """

    arch: str
    name: str
    architectures: str
    rope_permute: bool = False
    expert_ff_key: str = "expert_feed_forward_length"
    implied: dict[str, Any] = field(default_factory=dict)
    # llama.cpp's arch sizes k_norm to n_embd (olmoe): no grouped-query attention
    requires_mha: bool = False
    # the GGUF key of the shared expert's d_ff (qwen2moe), read from shared_expert_...
    shared_ff_key: str | None = None
    hparams: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, int] = field(default_factory=dict)
    partial_rotary: bool = False
    present: dict[str, str] = field(default_factory=dict)
    leading_dense: bool = False
    mla: bool = False
    importable: bool = True
    expert_biases: bool = False
    swa_pattern: int = 0

    @staticmethod
    def split_name(name: str) -> tuple[str, str]:
        """(base, suffix) of an HF tensor name as gguf's TensorNameMap looks it up:
        "...mlp.gate.e_score_correction_bias" -> ("...mlp.gate.e_score_correction", "bias")
        (llama.cpp's converter renames it so: GGUF `blk.N.exp_probs_b.bias`), "...sinks" ->
        ("...sinks", "weight") (GGUF `blk.N.attn_sinks.weight`), else the name
        split at its last dot ("...q_proj.weight" -> ("...q_proj", "weight"))."""
        if name.endswith(".e_score_correction_bias"):
            return name[: -len("_bias")], "bias"
        if name.endswith(".sinks"):  # gpt-oss's self_attn.sinks: GGUF attn_sinks.weight
            return name, "weight"
        base, _, suffix = name.rpartition(".")
        return base, suffix


@dataclass(frozen=True)
class Family:
    """Everything colibri knows about one Hugging Face model_type.

    model_spec: config.json dict (resolved by `resolve_config`: aliases mapped, defaults
    filled) -> ModelSpec; raises ValueError / KeyError / TypeError naming a bad field.
    defaults: the transformers config class's default of every key model_spec reads (a test
    checks them against transformers.AutoConfig.for_model); "rope_parameters" is the default
    rope dict, combined with `rope_theta` / `rope_scaling` as transformers does.
    aliases: the config class's attribute_map (alias -> key), e.g. qwen3_moe's num_experts.
    num_experts_key / d_ff_key: config keys of the routed expert count and one expert's
    intermediate size. experts: where the checkpoint keeps them.
    renames: (regex, replacement) applied to a transformers-5 dense tensor name to get the
    stored (hub) spelling, e.g. fused Mixtral's `mlp.gate` -> `block_sparse_moe.gate`.
    text_prefixes: multimodal checkpoints: (source prefix, stored prefix) of the language
    model's tensors (e.g. ("model.language_model.", "model.")); when set, every other tensor
    (vision tower, projector) is dropped with a note. text_model_type: the model_type of the
    `text_config` (the transformers config class whose defaults apply), when the family's
    config.json keeps the language model under `text_config`.
    gguf: the llama.cpp architecture, or None (no GGUF export / import).
    source_renames: (regex, replacement) applied in order to every tensor name of a
    checkpoint before anything else reads it: the hub's own (inference repo) spelling onto
    the one save_pretrained writes, e.g. DeepSeek-V4's `layers.0.attn.wq_a.weight` ->
    `model.layers.0.attn.wq_a.weight`; a name that becomes "" is dropped (with a note).
    test_configs: tiny configs for the tests, case name -> config overrides on top of the
    tests' common dims (hidden 64, 4 heads, 3 layers...); the case named `model_type` is the
    family's base case.
    """

    model_type: str
    model_spec: Callable[[dict[str, Any]], ModelSpec]
    defaults: dict[str, Any]
    num_experts_key: str
    d_ff_key: str
    aliases: dict[str, str] = field(default_factory=dict)
    experts: ExpertNames = field(default_factory=ExpertNames)
    renames: tuple[tuple[str, str], ...] = ()
    text_prefixes: tuple[tuple[str, str], ...] = ()
    text_model_type: str | None = None
    gguf: GGUFArch | None = None
    test_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    source_renames: tuple[tuple[str, str], ...] = ()

    def resolve_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """config.json as the family's model_spec reads it: the language model's
        `text_config` when there is one (model_type kept), aliases mapped to their keys, and
        every key the file leaves out set to the transformers config class default."""
        text = config.get("text_config")
        if self.text_model_type is not None and isinstance(text, dict):
            config = {**text, "model_type": config.get("model_type")}
        out = dict(config)
        for alias, key in self.aliases.items():
            if alias in out and key not in out:
                out[key] = out[alias]
        for key, value in self.defaults.items():
            if key != "rope_parameters" and key not in out:
                out[key] = value
        if "rope_parameters" in self.defaults:
            out["rope_parameters"] = _rope_parameters(config, self.defaults["rope_parameters"])
        return out

    def source_name(self, name: str) -> str:
        """The name checkpoint tensor `name` is read under ("" = dropped; see
        `source_renames`)."""
        for pattern, repl in self.source_renames:
            name = re.sub(pattern, repl, name)
        return name

    def rename(self, name: str) -> str:
        """The stored name of transformers-5 dense tensor `name` (see `renames`)."""
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        return name


def _rope_parameters(config: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """The rope dict transformers 5 builds: `rope_parameters` as given, else `rope_scaling`
    with `rope_theta` (or the default theta), else the class default with `rope_theta`
    replaced; a top-level `partial_rotary_factor` joins, and a default one fills a gap."""
    given = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    if isinstance(given, dict) and given:
        params = dict(given)
        params.setdefault("rope_theta", config.get("rope_theta", default["rope_theta"]))
    elif isinstance(scaling, dict) and scaling:
        params = dict(scaling)
        params.setdefault("rope_theta", config.get("rope_theta", default["rope_theta"]))
    else:
        params = dict(default)
        if config.get("rope_theta") is not None:
            params["rope_theta"] = config["rope_theta"]
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if "partial_rotary_factor" in default:
        params.setdefault("partial_rotary_factor", default["partial_rotary_factor"])
    return params
