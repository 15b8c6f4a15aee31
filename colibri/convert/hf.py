"""Hugging Face safetensors checkpoints -> store.

Reads safetensors headers ourselves and each tensor (or one expert's slice of a fused tensor,
or a run of rows) with one pread, so nothing is mapped and peak memory is about one expert in
float32 plus one 64 MiB chunk of a dense tensor. bf16 is widened exactly (bits << 16).

Expert layouts (transformers 5.x `save_pretrained`, checked with save_original_format
True/False):
  hub / original   ...layers.L.{block_sparse_moe|mlp}.experts.E.{w1,w3,w2 | gate_proj,
                   up_proj,down_proj}.weight   (Mixtral: w1 = gate, w3 = up, w2 = down)
  fused (tf 5)     ...layers.L.mlp.experts.gate_up_proj [E, 2*I, H] (gate rows first, then up)
                   ...layers.L.mlp.experts.down_proj    [E, H, I]
  gpt-oss (both)   gate_up_proj [E, H, 2*I], gate/up interleaved on the last dim (gate = ::2,
                   up = 1::2), gate_up_proj_bias [E, 2*I] (same interleave), down_proj
                   [E, I, H], down_proj_bias [E, H]
Dense names are stored in the original spelling: fused Mixtral's `mlp.gate.weight` becomes
`block_sparse_moe.gate.weight`; every other name is kept as saved.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri.convert import SUPPORTED_ARCHS, TOKENIZER_FILES, dense_qtype, progress, quantize
from colibri.errors import ConversionError, StoreError
from colibri.io.config import ConfigError, check_config
from colibri.io.format import ExpertLayout, StoreWriter, read_safetensors_header
from colibri.registry import model_spec

_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_PER_EXPERT = re.compile(
    r"^(?P<pre>model\.layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts)\.(?P<e>\d+)\."
    r"(?P<w>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<w>gate_up_proj|down_proj)(?P<b>_bias)?$"
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ROLE = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up"}
_ROLE["down_proj"] = "down"
_CHUNK_BYTES = 64 << 20  # dense tensors are converted this many source bytes at a time


# the routed-expert count's config key (transformers 5 renamed qwen*_moe's num_experts)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class _Arch:
    num_experts: str  # config key of the routed expert count
    d_ff: str  # config key of one expert's intermediate size
    fused: str  # "concat" ([E, 2I, H]) or "interleaved_t" (gpt-oss)


ARCHS = {
    "mixtral": _Arch("num_local_experts", "intermediate_size", "concat"),
    "qwen2_moe": _Arch("num_experts", "moe_intermediate_size", "concat"),
    "qwen3_moe": _Arch("num_experts", "moe_intermediate_size", "concat"),
    "olmoe": _Arch("num_experts", "intermediate_size", "concat"),
    "deepseek_v2": _Arch("n_routed_experts", "moe_intermediate_size", "concat"),
    "deepseek_v3": _Arch("n_routed_experts", "moe_intermediate_size", "concat"),
    "glm4_moe": _Arch("n_routed_experts", "moe_intermediate_size", "concat"),
    "gpt_oss": _Arch("num_local_experts", "intermediate_size", "interleaved_t"),
}
assert set(ARCHS) == set(SUPPORTED_ARCHS)


def moe_layer_ids(model_type: str, cfg: dict[str, Any]) -> list[int]:
    """Layers with routed experts, by each architecture's transformers rule."""
    n = int(cfg["num_hidden_layers"])
    if model_type in ("qwen2_moe", "qwen3_moe"):
        skip, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1))
        return [i for i in range(n) if i not in skip and (i + 1) % step == 0]
    if model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        return list(range(int(cfg.get("first_k_dense_replace", 0)), n))
    return list(range(n))


class Checkpoint:
    """The tensors of a safetensors checkpoint (one file, or shards listed by
    model.safetensors.index.json), known from headers only; read with pread on demand."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.meta: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}
        index = src / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise ConversionError(f"{index}: malformed ({exc})") from None
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: weight_map is not an object")
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or not fname or "/" in fname or fname == "..":
                    raise ConversionError(
                        f"{index}: weight_map[{name!r}] is {fname!r}, not a file name in {src}"
                    )
            files = sorted(set(weight_map.values()))
        elif (src / "model.safetensors").is_file():
            weight_map, files = {}, ["model.safetensors"]
        else:
            raise ConversionError(f"{src}: no model.safetensors or model.safetensors.index.json")
        for fname in files:
            path = src / fname
            if not path.is_file():
                raise ConversionError(f"{index}: shard {fname} is missing")
            try:
                header, start = read_safetensors_header(path)
            except StoreError as exc:
                raise ConversionError(str(exc)) from None
            for name, info in header.items():
                if weight_map and weight_map.get(name) != fname:
                    raise ConversionError(f"{path}: tensor {name!r} is not in {index.name}")
                dtype, shape = info["dtype"], tuple(info["shape"])
                if dtype not in _DTYPES:
                    raise ConversionError(
                        f"{path}: tensor {name!r} has dtype {dtype}; supported: BF16, F16, F32"
                    )
                b, e = info["data_offsets"]
                if e - b != int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize:
                    raise ConversionError(f"{path}: tensor {name!r}: data size != {shape}")
                self.meta[name] = (path, dtype, shape, start + b)
        for name, fname in weight_map.items():
            if name not in self.meta:
                raise ConversionError(f"{src / fname}: tensor {name!r} listed in index missing")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][2]

    def nbytes(self, name: str) -> int:
        _, dtype, shape, _ = self.meta[name]
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize

    def read(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """float32 [count, *shape[1:]]: rows first..first+count of the leading dim (default
        the whole tensor), read with one pread and widened exactly."""
        path, dtype, shape, start = self.meta[name]
        npdt = np.dtype(_DTYPES[dtype])
        if not shape:
            shape = (1,)
        count = shape[0] - first if count is None else count
        inner = int(np.prod(shape[1:], dtype=np.int64))
        nb = count * inner * npdt.itemsize
        with open(path, "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), nb, start + first * inner * npdt.itemsize)
        if len(raw) != nb:
            raise ConversionError(f"{path}: tensor {name!r} is cut short (truncated file)")
        a = np.frombuffer(raw, dtype=npdt).reshape(count, *shape[1:])
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


def _layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def _sort_key(name: str) -> tuple[int, str]:
    return (_layer_of(name), name)


def plan_experts(
    ck: Checkpoint, model_type: str, cfg: dict[str, Any]
) -> tuple[dict[int, dict[str, Any]], set[str], int, int, int]:
    """Find every expert tensor and check it against the config.

    Returns ({layer: {"per": {(e, role): name}} or {"fused": {key: name}}}, names used,
    num_experts, d_model, d_ff). Raises ConversionError for missing/extra experts, shapes
    that disagree with the config, or MoE layers other than the config's."""
    arch = ARCHS[model_type]
    try:
        E = int(cfg[next((k for k in _EXPERT_KEYS if k in cfg), arch.num_experts)])
        H, I = int(cfg["hidden_size"]), int(cfg[arch.d_ff])  # noqa: E741
        n_layers = int(cfg["num_hidden_layers"])
    except KeyError as exc:
        raise ConversionError(f"{ck.src / 'config.json'}: missing field {exc}") from None
    per: dict[int, dict[tuple[int, str], str]] = {}
    fused: dict[int, dict[str, str]] = {}
    for name in ck.meta:
        if m := _PER_EXPERT.match(name):
            layer, e = int(m["layer"]), int(m["e"])
            if e >= E:
                raise ConversionError(f"{ck.src}: extra tensor {name!r}: expert {e} >= {E}")
            per.setdefault(layer, {})[(e, _ROLE[m["w"]])] = name
        elif m := _FUSED.match(name):
            fused.setdefault(int(m["layer"]), {})[m["w"] + (m["b"] or "")] = name
    want = moe_layer_ids(model_type, cfg)
    have = sorted(set(per) | set(fused))
    have_in = [x for x in have if x < n_layers]
    if have_in != want:
        raise ConversionError(
            f"{ck.src}: config.json ({model_type}) puts experts in layers {_ranges(want)}, "
            f"the weights have them in layers {_ranges(have_in)}"
        )
    plan: dict[int, dict[str, Any]] = {}
    used: set[str] = set()
    for layer in want:
        if layer in per and layer in fused:
            raise ConversionError(f"{ck.src}: layer {layer} has both per-expert and fused experts")
        if layer in per:
            got = per[layer]
            for e in range(E):
                for role, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                    name = got.get((e, role))
                    if name is None:
                        raise ConversionError(
                            f"{ck.src}: missing tensor for layer {layer} expert {e} {role}"
                        )
                    _check_shape(ck, name, shape)
            plan[layer] = {"per": got}
            used |= set(got.values())
            continue
        got = fused[layer]
        if arch.fused == "interleaved_t":
            need = {
                "gate_up_proj": (E, H, 2 * I),
                "down_proj": (E, I, H),
                "gate_up_proj_bias": (E, 2 * I),
                "down_proj_bias": (E, H),
            }
        else:
            need = {"gate_up_proj": (E, 2 * I, H), "down_proj": (E, H, I)}
        for key, shape in need.items():
            if key not in got:
                raise ConversionError(
                    f"{ck.src}: missing tensor model.layers.{layer}.mlp.experts.{key}"
                )
            _check_shape(ck, got[key], shape)
        for key in set(got) - set(need):
            raise ConversionError(f"{ck.src}: unexpected tensor {got[key]!r}")
        plan[layer] = {"fused": got}
        used |= set(got.values())
    return plan, used, E, H, I


def _check_shape(ck: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    if ck.shape(name) != shape:
        raise ConversionError(
            f"{ck.meta[name][0]}: tensor {name!r} has shape {list(ck.shape(name))}, "
            f"config.json implies {list(shape)}"
        )


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return str(ids)


def dense_name(model_type: str, name: str) -> str:
    """The original-format (hub) name of a dense tensor saved by transformers 5."""
    if model_type == "mixtral":
        return re.sub(r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight", name)
    return name


def plan_dense(
    ck: Checkpoint, model_type: str, cfg: dict[str, Any], used: set[str], dense_quant: str
) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """[(source name, store name, qtype, shape)] of every dense tensor, layer order.

    Raises ConversionError for tensors of layers beyond num_hidden_layers (besides DeepSeek's
    num_nextn_predict_layers MTP layers, which are skipped), unexpected top-level names, and
    missing embeddings, final norm, lm_head (unless tied) or per-layer norms."""
    n = int(cfg["num_hidden_layers"])
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    out = []
    for name in sorted(set(ck.meta) - used, key=lambda n: _sort_key(dense_name(model_type, n))):
        layer = _layer_of(name)
        if layer >= n + mtp or (layer < 0 and not name.startswith(("model.", "lm_head."))):
            raise ConversionError(f"{ck.meta[name][0]}: unexpected tensor {name!r}")
        if layer >= n:
            continue  # multi-token-prediction layers: not used for generation
        qt = dense_qtype(dense_name(model_type, name), ck.shape(name), dense_quant)
        out.append((name, dense_name(model_type, name), qt, ck.shape(name)))
    names = {x[1] for x in out}
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.get("tie_word_embeddings", False):
        need.append("lm_head.weight")
    for i in range(n):
        need += [f"model.layers.{i}.input_layernorm.weight"]
    for name in need:
        if name not in names:
            raise ConversionError(f"{ck.src}: missing tensor {name!r}")
    emb = ck.shape("model.embed_tokens.weight")
    if "vocab_size" in cfg and emb != (int(cfg["vocab_size"]), int(cfg["hidden_size"])):
        raise ConversionError(
            f"{ck.src}: tensor 'model.embed_tokens.weight' has shape {list(emb)}, config.json "
            f"vocab_size x hidden_size is {[cfg['vocab_size'], cfg['hidden_size']]}"
        )
    return out


def _expert_parts(ck: Checkpoint, spec: dict[str, Any], e: int, I: int) -> dict[str, np.ndarray]:  # noqa: E741
    """Float32 gate [I, H], up [I, H], down [H, I] (+ biases) of expert `e`."""
    if "per" in spec:
        return {role: ck.read(spec["per"][(e, role)]) for role in ("gate", "up", "down")}
    f = spec["fused"]
    gu = ck.read(f["gate_up_proj"], e, 1)[0]
    down = ck.read(f["down_proj"], e, 1)[0]
    if "gate_up_proj_bias" not in f:  # [2I, H]: gate rows then up rows
        return {"gate": gu[:I], "up": gu[I:], "down": down}
    gb = ck.read(f["gate_up_proj_bias"], e, 1)[0]
    return {  # gpt-oss: [H, 2I] interleaved, down [I, H]: transpose to y = W x
        "gate": gu[:, 0::2].T,
        "up": gu[:, 1::2].T,
        "down": down.T,
        "gate_bias": gb[0::2],
        "up_bias": gb[1::2],
        "down_bias": ck.read(f["down_proj_bias"], e, 1)[0],
    }


def copy_tokenizer(src: Path, w: StoreWriter) -> None:
    """Carry over the tokenizer files; make tokenizer.json from a tokenizer.model if needed."""
    for fname in TOKENIZER_FILES:
        if (src / fname).is_file():
            w.add_file(fname, (src / fname).read_bytes())
    if not (src / "tokenizer.json").is_file() and (src / "tokenizer.model").is_file():
        tok = spm_to_tokenizer_json(src / "tokenizer.model", src / "tokenizer_config.json")
        w.add_file("tokenizer.json", tok)


def spm_to_tokenizer_json(path: Path, tokenizer_config: Path | None = None) -> bytes:
    """tokenizer.json text for a SentencePiece model file, made the way transformers loads a
    tokenizer.model-only checkpoint (AutoTokenizer; needs transformers, sentencepiece and
    protobuf). `tokenizer_config` (if given) picks the tokenizer class; default Llama's."""
    import shutil
    import tempfile

    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConversionError(
            f"{path}: making tokenizer.json from a SentencePiece model needs transformers, "
            f"sentencepiece and protobuf ({exc})"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(path, Path(tmp) / "tokenizer.model")
        if tokenizer_config is not None and tokenizer_config.is_file():
            shutil.copy(tokenizer_config, Path(tmp) / "tokenizer_config.json")
        else:
            (Path(tmp) / "tokenizer_config.json").write_text(
                '{"tokenizer_class": "LlamaTokenizer"}'
            )
        try:
            tok = AutoTokenizer.from_pretrained(tmp)
            return tok.backend_tokenizer.to_str().encode()
        except Exception as exc:
            raise ConversionError(f"{path}: cannot convert SentencePiece model: {exc}") from None


def convert_hf(
    src: Path, out: Path, quant: str, dense_quant: str, force: bool, show_progress: bool
) -> Path:
    """Convert the HF checkpoint directory `src` into a store at `out` (see colibri.convert)."""
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{src}: no config.json (not a Hugging Face checkpoint)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, RecursionError) as exc:
        raise ConversionError(f"{cfg_path}: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConversionError(f"{cfg_path}: is a JSON {type(cfg).__name__}, not an object")
    model_type = cfg.get("model_type")
    if model_type not in ARCHS:
        raise ConversionError(
            f"{cfg_path}: unsupported architecture {model_type!r}; supported: "
            + ", ".join(SUPPORTED_ARCHS)
        )
    try:
        check_config(cfg, cfg_path)
    except ConfigError as exc:
        raise ConversionError(str(exc)) from None
    ck = Checkpoint(src)
    top = max((_layer_of(n) for n in ck.meta), default=-1)
    if cfg["num_hidden_layers"] > top + 1:  # before anything is sized from it
        raise ConversionError(
            f"{cfg_path}: field 'num_hidden_layers' is {cfg['num_hidden_layers']}, but the "
            f"checkpoint's tensors cover {top + 1} layers"
        )
    try:  # every field the family reads, as the engine will read it
        model_spec(cfg)
    except StoreError as exc:
        raise ConversionError(f"{cfg_path}: {exc}") from None
    experts, used, E, H, I = plan_experts(ck, model_type, cfg)  # noqa: E741
    dense = plan_dense(ck, model_type, cfg, used, dense_quant)
    try:
        layout = ExpertLayout.build(quant, H, I, biases=ARCHS[model_type].fused == "interleaved_t")
    except StoreError as exc:  # block formats need columns (d_model, d_ff) in 32s
        raise ConversionError(
            f"{src}: experts of hidden_size {H} x d_ff {I} cannot be stored as --quant {quant}: "
            f"{exc}; use f16, bf16 or f32"
        ) from None
    total = sum(ck.nbytes(n) for n in ck.meta)
    bar = progress(total, f"convert {src.name}") if show_progress else None
    try:
        with StoreWriter(out, layout, force=force) as w:
            w.begin_dense([(store, qt, shape) for _, store, qt, shape in dense])
            for name, store, qt, shape in dense:
                rows = shape[0] if shape else 1
                step = max(1, _CHUNK_BYTES // max(1, ck.nbytes(name) // rows))
                for r in range(0, rows, step):
                    x = ck.read(name, r, min(step, rows - r)) if shape else ck.read(name)
                    w.write_dense(store, quantize(x, qt) if qt != "f32" else x)
                _tick(bar, ck.nbytes(name), 1, len(ck.meta))
            for layer, spec in experts.items():
                for e in range(E):
                    parts = _expert_parts(ck, spec, e, I)
                    for k in ("gate", "up", "down"):  # biases stay f32
                        parts[k] = quantize(parts[k], quant)
                    w.write_expert(layer, e, parts)
                names = _names(spec)
                _tick(bar, sum(ck.nbytes(n) for n in names), len(names), len(ck.meta))
            copy_tokenizer(src, w)
            return w.finish(model_type, cfg, {"kind": "hf", "name": src.name})
    finally:
        if bar is not None:
            bar.close()


def _names(spec: dict[str, Any]) -> list[str]:
    return list(spec.get("per", spec.get("fused", {})).values())


def _tick(bar: Any, nbytes: int, ntensors: int, total: int) -> None:
    if bar is not None:
        bar.ntensors = getattr(bar, "ntensors", 0) + ntensors
        bar.set_postfix_str(f"{bar.ntensors}/{total} tensors", refresh=False)
        bar.update(nbytes)
