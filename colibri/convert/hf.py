"""Hugging Face safetensors checkpoints -> store.

Reads safetensors headers ourselves and each tensor (or one expert's slice of a fused tensor,
or a run of rows) with one pread, so nothing is mapped and peak memory is about one expert in
float32 plus one 64 MiB chunk of a dense tensor. bf16 is widened exactly (bits << 16).
Checkpoints shipped quantized (config.json `quantization_config`: FP8 block-scaled `weight` +
`weight_scale_inv`, gpt-oss MXFP4 `*_blocks` / `*_scales`) are decoded exactly, or kept as
they are when `--quant` is their own type (SourceWeights, colibri.convert.quantized).

Expert layouts are the family's (models/<model_type>.py, Family.experts; transformers 5.x
`save_pretrained` with save_original_format True/False):
  hub / original   one tensor per expert and projection, e.g. Mixtral's
                   ...layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight (gate, up, down)
  fused (tf 5)     ...layers.L.mlp.experts.gate_up_proj [E, 2*I, H] (gate rows first, then up)
                   ...layers.L.mlp.experts.down_proj    [E, H, I]
  Llama 4 (both)   gate_up_proj [E, H, 2*I] (gate columns first, then up), down_proj [E, I, H]
  gpt-oss (both)   gate_up_proj [E, H, 2*I], gate/up interleaved on the last dim (gate = ::2,
                   up = 1::2), gate_up_proj_bias [E, 2*I] (same interleave), down_proj
                   [E, I, H], down_proj_bias [E, H]
Dense names are stored in the original spelling (Family.renames: fused Mixtral's
`mlp.gate.weight` becomes `block_sparse_moe.gate.weight`); every other name is kept as saved.
A multimodal family's language-model prefixes are renamed and the rest dropped
(Family.text_prefixes). Dense tensors are checked against the spec's (models.spec.dense_tensors).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from colibri.convert import TOKENIZER_FILES, dense_qtype, progress, quantize
from colibri.convert.quantized import (
    FP8_STORE_BLOCK,
    SourceQuant,
    check_fp8_scale,
    e4m3_to_f32,
    e8m0_to_f32,
    fp4_dequantize,
    fp4_to_ggml,
    fp8_dequantize,
    mxfp4_dequantize,
    mxfp4_to_ggml,
    source_quant,
)
from colibri.errors import ConversionError, StoreError
from colibri.io.config import ConfigError, check_config, text_view
from colibri.io.format import ExpertLayout, StoreWriter, fp8_rows, read_safetensors_header
from colibri.models.family import Family
from colibri.models.spec import ModelSpec, dense_tensors, f32_tensors
from colibri.registry import family, model_spec

# safetensors dtype -> numpy dtype of the stored elements; F8_E4M3 (FP8 checkpoints), U8
# (gpt-oss MXFP4 blocks / scales), F8_E8M0 (UE8M0 scales) and I8 / F4 (DeepSeek-V4's
# FP4-packed experts) are kept as bytes (colibri.convert.quantized decodes them)
_DTYPES = {
    "BF16": np.uint16,
    "F16": np.float16,
    "F32": np.float32,
    "F8_E4M3": np.uint8,
    "F8_E8M0": np.uint8,
    "U8": np.uint8,
    "I8": np.int8,
    "F4": np.uint8,  # float4_e2m1fn_x2, two E2M1 a byte (read as [..., last / 2] bytes)
    "I64": np.int64,  # only DeepSeek-V4's tid2eid tables (_INT_NAMES): ids, exact in f32
    "I32": np.int32,
}
_INT_NAMES = re.compile(r"\.tid2eid$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_CHUNK_BYTES = 64 << 20  # dense tensors are converted this many source bytes at a time


def _pattern(fmt: str, **groups: str) -> re.Pattern[str]:
    """A regex matching the names that format string `fmt` (ExpertNames) produces, each
    {field} a named group matching groups[field]."""
    out = ""
    for part in re.split(r"(\{\w+\})", fmt):
        key = part[1:-1] if part.startswith("{") else None
        out += f"(?P<{key}>{groups[key]})" if key else re.escape(part)
    return re.compile(f"^{out}$")


def expert_patterns(fam: Family) -> tuple[re.Pattern[str] | None, re.Pattern[str], dict[str, str]]:
    """(per-expert regex or None, fused regex, {proj spelling: role}) of `fam`'s experts."""
    ex = fam.experts
    role_of = {proj: role for role, proj in ex.projs.items()}
    per = None
    if ex.per_expert is not None:
        projs = "|".join(re.escape(p) for p in role_of)
        per = _pattern(ex.per_expert, layer=r"\d+", expert=r"\d+", proj=projs)
    b = "(?:_bias|_blocks|_scales)?"  # _blocks / _scales: gpt-oss MXFP4
    fused = _pattern(ex.fused + ".{w}{b}", layer=r"\d+", w="gate_up_proj|down_proj", b=b)
    return per, fused, role_of


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
                if dtype not in _DTYPES or (
                    dtype in ("I64", "I32") and not _INT_NAMES.search(name)
                ):
                    raise ConversionError(
                        f"{path}: tensor {name!r} has dtype {dtype}; supported: "
                        + ", ".join(_DTYPES)
                    )
                if dtype == "F4":  # the bytes' shape; the values' is the logical one
                    shape = (*shape[:-1], shape[-1] // 2) if shape else shape
                b, e = info["data_offsets"]
                if e - b != int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize:
                    raise ConversionError(f"{path}: tensor {name!r}: data size != {shape}")
                self.meta[name] = (path, dtype, shape, start + b)
        for name, fname in weight_map.items():
            if name not in self.meta:
                raise ConversionError(f"{src / fname}: tensor {name!r} listed in index missing")
        self.logical: dict[str, tuple[int, ...]] = {}  # packed tensors' unpacked shapes
        self.saved_as: dict[str, str] = {}  # name read -> the file's own (Family.source_renames)

    def called(self, name: str) -> str:
        """`name` quoted for a message, with the file's own spelling when it was renamed."""
        saved = self.saved_as.get(name)
        return repr(name) if saved is None else f"{saved!r} (read as {name!r})"

    def rename(self, fam: Family) -> None:
        """Read the tensors under `fam`'s names for them (Family.source_renames): the hub's
        own spelling onto the one save_pretrained writes; names mapped to "" are dropped
        with a note. Raises ConversionError when two tensors map to one name."""
        if not fam.source_renames:
            return
        meta, dropped = {}, {}
        for name, info in self.meta.items():
            new = fam.source_name(name)
            if not new:
                key = ".".join(name.split(".")[:1])
                dropped[key] = dropped.get(key, 0) + 1
                continue
            if new in meta:
                raise ConversionError(
                    f"{self.src}: tensors {name!r} and another both read as {new!r}"
                )
            meta[new] = info
            if new != name:
                self.saved_as[new] = name
        self.meta = meta
        if dropped:
            what = ", ".join(f"{k}.* ({n})" for k, n in sorted(dropped.items()))
            print(f"note: {self.src}: dropped {what} (not used for generation)", file=sys.stderr)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape; a packed one's unpacked (FP4 [out, in], not [out, in / 2])."""
        return self.logical.get(name, self.meta[name][2])

    def nbytes(self, name: str) -> int:
        _, dtype, shape, _ = self.meta[name]
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype ("BF16", "F8_E4M3", ...)."""
        return self.meta[name][1]

    def read_raw(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """The stored elements of rows first..first+count of the leading dim (default the
        whole tensor), one pread: uint16 bf16 bits, float16, float32 or uint8 (F8_E4M3, U8)."""
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
        return np.frombuffer(raw, dtype=npdt).reshape(count, *shape[1:])

    def read(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """float32 [count, *shape[1:]]: rows first..first+count of the leading dim (default
        the whole tensor), read with one pread and widened exactly (F8_E4M3: the e4m3
        values, without their block scales; F8_E8M0: 2^(b - 127); see
        colibri.convert.quantized)."""
        a = self.read_raw(name, first, count)
        dtype = self.meta[name][1]
        if dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if dtype == "F8_E4M3":
            return e4m3_to_f32(a)
        if dtype == "F8_E8M0":
            return e8m0_to_f32(a)
        return a.astype(np.float32)


def _layer_of(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def _sort_key(name: str) -> tuple[int, str]:
    return (_layer_of(name), name)


def text_names(ck: Checkpoint, fam: Family) -> dict[str, str]:
    """{source name: language-model name} of the checkpoint's tensors. For a multimodal
    family (Family.text_prefixes) the language model's prefixes are renamed and every other
    tensor is dropped, with a note saying how many and under which prefixes."""
    if not fam.text_prefixes:
        return {name: name for name in ck.meta}
    out, dropped = {}, {}
    for name in ck.meta:
        for src, dst in fam.text_prefixes:
            if name.startswith(src):
                out[name] = dst + name[len(src) :]
                break
        else:
            top = name.split(".", 2)
            key = ".".join(top[:2]) if len(top) > 2 else top[0]
            dropped[key] = dropped.get(key, 0) + 1
    if dropped:
        what = ", ".join(f"{k}.* ({n})" for k, n in sorted(dropped.items()))
        print(f"note: {ck.src}: kept the language model only; dropped {what}", file=sys.stderr)
    return out


def plan_experts(
    ck: Checkpoint, fam: Family, spec: ModelSpec, names: dict[str, str]
) -> tuple[dict[int, dict[str, Any]], set[str], int, int, int]:
    """Find every expert tensor (names: source name -> language-model name, see text_names)
    and check it against the spec.

    Returns ({layer: {"per": {(e, role): name}} or {"fused": {key: name}}}, names used,
    num_experts, d_model, d_ff). Raises ConversionError for missing/extra experts, shapes
    that disagree with the config, or MoE layers other than the config's."""
    E, H, I = spec.moe.router.num_experts, spec.d_model, spec.moe.d_ff  # noqa: E741
    n_layers = len(spec.layers)
    per_re, fused_re, role_of = expert_patterns(fam)
    per: dict[int, dict[tuple[int, str], str]] = {}
    fused: dict[int, dict[str, str]] = {}
    for name, text in names.items():
        if per_re is not None and (m := per_re.match(text)):
            layer, e = int(m["layer"]), int(m["expert"])
            if e >= E:
                raise ConversionError(f"{ck.src}: extra tensor {name!r}: expert {e} >= {E}")
            per.setdefault(layer, {})[(e, role_of[m["proj"]])] = name
        elif m := fused_re.match(text):
            fused.setdefault(int(m["layer"]), {})[m["w"] + m["b"]] = name
    want = [layer.index for layer in spec.layers if layer.moe]
    have = sorted(set(per) | set(fused))
    have_in = [x for x in have if x < n_layers]
    if have_in != want:
        raise ConversionError(
            f"{ck.src}: config.json ({fam.model_type}) puts experts in layers {_ranges(want)}, "
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
        if fam.experts.fused_layout == "interleaved_t" and "gate_up_proj_blocks" in got:
            if H % 32 or I % 32:
                raise ConversionError(f"{ck.src}: MXFP4 experts need d_model, d_ff % 32 == 0")
            need = {  # hub MXFP4: [E, out, in / 32, 16] blocks, [E, out, in / 32] E8M0 scales
                "gate_up_proj_blocks": (E, 2 * I, H // 32, 16),
                "gate_up_proj_scales": (E, 2 * I, H // 32),
                "down_proj_blocks": (E, H, I // 32, 16),
                "down_proj_scales": (E, H, I // 32),
                "gate_up_proj_bias": (E, 2 * I),
                "down_proj_bias": (E, H),
            }
        elif fam.experts.fused_layout == "interleaved_t":
            need = {
                "gate_up_proj": (E, H, 2 * I),
                "down_proj": (E, I, H),
                "gate_up_proj_bias": (E, 2 * I),
                "down_proj_bias": (E, H),
            }
        elif fam.experts.fused_layout == "concat_t":
            need = {"gate_up_proj": (E, H, 2 * I), "down_proj": (E, I, H)}
        else:
            need = {"gate_up_proj": (E, 2 * I, H), "down_proj": (E, H, I)}
        prefix = fam.experts.fused.format(layer=layer)
        for key, shape in need.items():
            if key not in got:
                raise ConversionError(f"{ck.src}: missing tensor {prefix}.{key}")
            _check_shape(ck, got[key], shape)
        for key in set(got) - set(need):
            raise ConversionError(f"{ck.src}: unexpected tensor {got[key]!r}")
        plan[layer] = {"fused": got}
        if fam.experts.fused_layout == "concat_t":
            plan[layer]["transposed"] = True
        used |= set(got.values())
    return plan, used, E, H, I


def _check_shape(ck: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    if ck.shape(name) != shape:
        raise ConversionError(
            f"{ck.meta[name][0]}: tensor {ck.called(name)} has shape {list(ck.shape(name))}, "
            f"config.json implies {list(shape)}"
        )


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return str(ids)


def plan_dense(
    ck: Checkpoint,
    fam: Family,
    spec: ModelSpec,
    cfg: dict[str, Any],
    names: dict[str, str],
    used: set[str],
    dense_quant: str,
) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """[(source name, store name, qtype, shape)] of every dense tensor, layer order; store
    names are the hub spelling (Family.rename of the language-model name).

    Raises ConversionError for tensors of layers beyond num_hidden_layers (besides DeepSeek's
    num_nextn_predict_layers MTP layers, which are skipped), unexpected top-level names, and
    any tensor the spec expects (models.spec.dense_tensors) that is missing or has another
    shape; other tensors inside a layer are kept as they are."""
    n = len(spec.layers)
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    stored = {name: fam.rename(names[name]) for name in names if name not in used}
    f32 = f32_tensors(spec)
    out = []
    for name in sorted(stored, key=lambda x: _sort_key(stored[x])):
        layer = _layer_of(stored[name])
        top = ("model.", "lm_head.", f"{spec.lm_head}.")  # DeepSeek-V4's is `head`
        if layer >= n + mtp or (layer < 0 and not stored[name].startswith(top)):
            raise ConversionError(f"{ck.meta[name][0]}: unexpected tensor {ck.called(name)}")
        if layer >= n:
            continue  # multi-token-prediction layers: not used for generation
        qt = dense_qtype(stored[name], ck.shape(name), dense_quant, f32)
        out.append((name, stored[name], qt, ck.shape(name)))
    shapes = {store: shape for _, store, _, shape in out}
    for name, shape in dense_tensors(spec).items():
        if name not in shapes:
            raise ConversionError(f"{ck.src}: missing tensor {ck.called(name)}")
        if shapes[name] != shape:
            raise ConversionError(
                f"{ck.src}: tensor {ck.called(name)} has shape {list(shapes[name])}, config.json "
                f"implies {list(shape)}"
            )
    return out


class SourceWeights:
    """A checkpoint's weights decoded from the source's own quantization (config.json
    `quantization_config`, colibri.convert.quantized): FP8 `X.weight` + `X.weight_scale_inv`
    pairs dequantized exactly or kept as store `fp8` rows; DeepSeek-V4's FP4 experts (I8
    `X.weight` [out, in / 2] with expert_dtype "fp4", or safetensors F4 [out, in], the same
    bytes; + UE8M0 `X.weight_scale_inv` [out, in / 32]) dequantized exactly or kept as store
    `mxfp4` blocks; everything else as Checkpoint.read.

    Raises ConversionError (naming the tensor) for an F8_E4M3 / I8 weight without its scales,
    a scale without its weight or of the wrong grid or dtype, FP8 / FP4 / U8 tensors the
    config's quantization does not explain."""

    def __init__(self, ck: Checkpoint, sq: SourceQuant | None) -> None:
        self.ck, self.sq = ck, sq
        self.scale_of: dict[str, str] = {}  # FP8 / FP4 weight name -> its scale's name
        self.fp4: set[str] = set()  # the FP4 weights among them
        method = sq.method if sq else None
        for name in ck.meta:
            if not name.endswith(".weight_scale_inv"):
                continue
            weight = name[: -len("_scale_inv")]
            wdt = ck.dtype(weight) if weight in ck.meta else None
            if wdt not in ("F8_E4M3", "I8", "F4"):
                raise ConversionError(
                    f"{ck.meta[name][0]}: {ck.called(name)} has no F8_E4M3 (or FP4-packed I8) "
                    f"{ck.called(weight)}"
                )
            if sq is None or method != "fp8":
                raise ConversionError(
                    f"{ck.src}: tensor {ck.called(weight)} is "
                    f"{'FP8' if wdt == 'F8_E4M3' else 'FP4'} but config.json has no "
                    "quantization_config with quant_method 'fp8'"
                )
            sdt = ck.dtype(name)
            if sdt not in ("F32", "BF16", "F8_E8M0", "U8"):
                raise ConversionError(
                    f"{ck.meta[name][0]}: scale {ck.called(name)} has dtype {sdt} (need F32, "
                    "BF16 or UE8M0 bytes F8_E8M0 / U8)"
                )
            if wdt in ("I8", "F4"):
                rows, half = ck.meta[weight][2] if len(ck.meta[weight][2]) == 2 else (0, 0)
                if (wdt == "I8" and sq.expert_dtype != "fp4") or sdt not in ("F8_E8M0", "U8"):
                    raise ConversionError(
                        f"{ck.meta[weight][0]}: tensor {ck.called(weight)} is {wdt} (FP4-packed)"
                        "; that needs expert_dtype 'fp4' in config.json and UE8M0 scales, got "
                        f"expert_dtype {sq.expert_dtype!r} and a {sdt} scale"
                    )
                if not rows or half % 16 or ck.shape(name) != (rows, half // 16):
                    raise ConversionError(
                        f"{ck.meta[name][0]}: FP4 tensor {ck.called(weight)} "
                        f"{list(ck.meta[weight][2])} needs a scale of [{rows}, {half // 16}] "
                        "(one per 32 weights), "
                        f"{ck.called(name)} is {list(ck.shape(name))}"
                    )
                ck.logical[weight] = (rows, 2 * half)
                self.fp4.add(weight)
            else:
                check_fp8_scale(weight, ck.shape(weight), ck.shape(name), sq.block)
            self.scale_of[weight] = name
        self.aux = set(self.scale_of.values())  # tensors read only as part of another
        for name in ck.meta:
            dtype = ck.dtype(name)
            if dtype in ("F8_E4M3", "I8", "F4") and name not in self.scale_of:
                raise ConversionError(
                    f"{ck.meta[name][0]}: {dtype} tensor {ck.called(name)} has no weight_scale_inv "
                    "(hub spelling: .scale)"
                )
            if (
                dtype in ("U8", "F8_E8M0")
                and name not in self.aux
                and (method != "mxfp4" or not name.endswith(("_blocks", "_scales")))
            ):
                raise ConversionError(
                    f"{ck.meta[name][0]}: tensor {ck.called(name)} is {dtype}; only MXFP4 experts' "
                    "_blocks / _scales (quantization_config quant_method 'mxfp4') and FP8 / "
                    "FP4 weights' scales are"
                )

    def read(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """float32 rows first..first+count of `name` (FP8: e4m3 x block scale; FP4: E2M1 x
        its group's UE8M0 scale; exactly)."""
        if name not in self.scale_of:
            return self.ck.read(name, first, count)
        assert self.sq is not None
        if name in self.fp4:
            return fp4_dequantize(
                self.ck.read_raw(name, first, count),
                self.ck.read_raw(self.scale_of[name], first, count),
            )
        scale = self.scale(name)
        return fp8_dequantize(self.ck.read_raw(name, first, count), scale, self.sq.block, first)

    def scale(self, name: str) -> np.ndarray:
        """float32 block scales of FP8 / FP4 weight `name` (UE8M0 bytes decoded exactly)."""
        scale = self.scale_of[name]
        if self.ck.dtype(scale) in ("F8_E8M0", "U8"):
            return e8m0_to_f32(self.ck.read_raw(scale))
        return self.ck.read(scale)

    def keeps_fp8(self, name: str) -> bool:
        """Whether `name` is FP8 with 128x128 blocks, i.e. its bytes fit the store's fp8."""
        return (
            name in self.scale_of
            and name not in self.fp4
            and self.sq is not None
            and self.sq.block == (128, 128)
        )

    def fp8_rows(self, name: str, first: int = 0, count: int | None = None) -> np.ndarray:
        """The store's fp8 rows (io.format.fp8_rows) of rows first.. (a multiple of 128) of
        FP8 tensor `name`: its e4m3 bytes and block scales, unchanged."""
        w = self.ck.read_raw(name, first, count)
        b = FP8_STORE_BLOCK
        scale = self.scale(name)[first // b : first // b + -(-len(w) // b)]
        return fp8_rows(w, scale)

    def stored(self, name: str, qtype: str) -> np.ndarray:
        """Tensor `name` in store type `qtype`: kept byte for byte when the source already is
        in it (fp8; FP4 as mxfp4), else quantized from the exactly decoded float32 values."""
        if qtype == "fp8" and self.keeps_fp8(name):
            return self.fp8_rows(name)
        if qtype == "mxfp4" and name in self.fp4:
            return fp4_to_ggml(self.ck.read_raw(name), self.ck.read_raw(self.scale_of[name]))
        x = self.read(name)
        return x if qtype == "f32" else quantize(x, qtype)


def _expert_parts(
    sw: SourceWeights,
    spec: dict[str, Any],
    e: int,
    I: int,  # noqa: E741
    quant: str,
) -> dict[str, np.ndarray]:
    """Expert `e`'s gate [I, H], up [I, H], down [H, I] in store type `quant` (+ f32 biases):
    source bytes kept where they already are `quant` (FP8 as fp8, MXFP4 as mxfp4), else
    quantized from the exactly decoded float32 weights."""
    ck = sw.ck
    if "per" in spec:
        return {role: sw.stored(spec["per"][(e, role)], quant) for role in ("gate", "up", "down")}
    f = spec["fused"]
    if "gate_up_proj_blocks" in f:  # gpt-oss MXFP4: rows [2I] interleaved gate/up, [H]
        gub, gus = (
            ck.read_raw(f[k], e, 1)[0] for k in ("gate_up_proj_blocks", "gate_up_proj_scales")
        )
        dnb, dns = (ck.read_raw(f[k], e, 1)[0] for k in ("down_proj_blocks", "down_proj_scales"))
        parts = {}
        for role, b, s in (("gate", gub[0::2], gus[0::2]), ("up", gub[1::2], gus[1::2]),
                           ("down", dnb, dns)):  # fmt: skip
            if quant == "mxfp4":
                parts[role] = mxfp4_to_ggml(b, s)
            else:
                parts[role] = quantize(mxfp4_dequantize(b, s), quant)
        gb = ck.read(f["gate_up_proj_bias"], e, 1)[0]
        parts |= {"gate_bias": gb[0::2], "up_bias": gb[1::2]}
        parts["down_bias"] = ck.read(f["down_proj_bias"], e, 1)[0]
        return parts
    gu = ck.read(f["gate_up_proj"], e, 1)[0]
    down = ck.read(f["down_proj"], e, 1)[0]
    if spec.get("transposed"):  # Llama 4: [H, 2I] gate columns then up, down [I, H]
        parts = {"gate": gu[:, :I].T, "up": gu[:, I:].T, "down": down.T}
    elif "gate_up_proj_bias" not in f:  # [2I, H]: gate rows then up rows
        parts = {"gate": gu[:I], "up": gu[I:], "down": down}
    else:
        gb = ck.read(f["gate_up_proj_bias"], e, 1)[0]
        parts = {  # gpt-oss: [H, 2I] interleaved, down [I, H]: transpose to y = W x
            "gate": gu[:, 0::2].T,
            "up": gu[:, 1::2].T,
            "down": down.T,
            "gate_bias": gb[0::2],
            "up_bias": gb[1::2],
            "down_bias": ck.read(f["down_proj_bias"], e, 1)[0],
        }
    for k in ("gate", "up", "down"):  # biases stay f32
        parts[k] = quantize(parts[k], quant)
    return parts


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
    tokenizer.model-only checkpoint (AutoTokenizer, with transformers, sentencepiece and
    protobuf installed; `tokenizer_config` (if given) picks the tokenizer class, default
    Llama's). Without transformers: spm_model_tokenizer's byte-fallback BPE (Llama-style
    vocabularies: Llama 2, Mistral, Mixtral). Raises ConversionError for a file that is not a
    SentencePiece model."""
    import shutil
    import tempfile

    try:
        from transformers import AutoTokenizer
    except ImportError:  # without transformers: the same construction from the model file
        return spm_model_tokenizer(path).to_str().encode()
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


def _proto_fields(buf: bytes, where: str) -> list[tuple[int, int, Any]]:
    """The (field number, wire type, value) of one protobuf message: varints as int,
    length-delimited fields as bytes, fixed32 / fixed64 as their raw bytes."""
    out, i, n = [], 0, len(buf)

    def varint() -> int:
        nonlocal i
        v = shift = 0
        while True:
            if i >= n or shift > 63:
                raise ConversionError(f"{where}: not a SentencePiece model (bad varint)")
            b = buf[i]
            i += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return v

    while i < n:
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            out.append((field, wire, varint()))
            continue
        size = {1: 8, 5: 4}.get(wire)
        if size is None:
            if wire != 2:
                raise ConversionError(f"{where}: not a SentencePiece model (wire type {wire})")
            size = varint()
        if i + size > n:
            raise ConversionError(f"{where}: not a SentencePiece model (truncated)")
        out.append((field, wire, buf[i : i + size]))
        i += size
    return out


def spm_model_tokenizer(path: Path) -> Any:
    """A tokenizers.Tokenizer for the SentencePiece model file `path` (sentencepiece's
    ModelProto: pieces = field 1, each piece / score / type = 1 / 2 / 3; normalizer_spec = 3
    with add_dummy_prefix = 3), built as a byte-fallback BPE the way transformers'
    LlamaConverter builds one (colibri.convert.gguf's SentencePiece construction, the pieces
    standing for GGUF's tokens, scores and token types). Needs neither transformers nor
    sentencepiece. Raises ConversionError for a file that is not such a model."""
    import struct

    from colibri.convert.gguf import _spm_tokenizer  # the convert package's own

    where = str(path)
    tokens, scores, types, prefix = [], [], [], True
    for field, wire, value in _proto_fields(Path(path).read_bytes(), where):
        if field == 1 and wire == 2:
            piece, score, kind = None, 0.0, 1  # the proto's defaults: type NORMAL
            for f, w, v in _proto_fields(value, where):
                if f == 1 and w == 2:
                    piece = v.decode("utf-8", "replace")
                elif f == 2 and w == 5:
                    score = struct.unpack("<f", v)[0]
                elif f == 3 and w == 0:
                    kind = v
            if piece is None:
                raise ConversionError(f"{where}: not a SentencePiece model (a piece lacks text)")
            tokens.append(piece)
            scores.append(score)
            types.append(kind)
        elif field == 3 and wire == 2:
            for f, w, v in _proto_fields(value, where):
                if f == 3 and w == 0:
                    prefix = bool(v)
    if not tokens:
        raise ConversionError(f"{where}: not a SentencePiece model (no pieces)")
    return _spm_tokenizer(
        {
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.add_space_prefix": prefix,
        }
    )


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
    try:
        fam = family(cfg.get("model_type"))
    except StoreError as exc:
        raise ConversionError(f"{cfg_path}: {exc}") from None
    try:
        check_config(cfg, cfg_path)
    except ConfigError as exc:
        raise ConversionError(str(exc)) from None
    ck = Checkpoint(src)
    ck.rename(fam)
    names = text_names(ck, fam)
    n_layers = text_view(cfg)["num_hidden_layers"]
    top = max((_layer_of(n) for n in names.values()), default=-1)
    if n_layers > top + 1:  # before anything is sized from it
        raise ConversionError(
            f"{cfg_path}: field 'num_hidden_layers' is {n_layers}, but the "
            f"checkpoint's tensors cover {top + 1} layers"
        )
    try:  # every field the family reads, as the engine will read it
        spec = model_spec(cfg)
    except StoreError as exc:
        raise ConversionError(f"{cfg_path}: {exc}") from None
    model_type = fam.model_type
    sq = source_quant(cfg, cfg_path)
    sw = SourceWeights(ck, sq)
    if sq is not None and sq.method == "fp8" and quant == "fp8" and sq.block != (128, 128):
        print(
            f"note: {cfg_path}: weight_block_size {list(sq.block)} is not the store's 128x128; "
            "FP8 experts are requantized into 128x128 blocks from their exact values",
            file=sys.stderr,
        )
    names = {k: v for k, v in names.items() if k not in sw.aux}
    experts, used, E, H, I = plan_experts(ck, fam, spec, names)  # noqa: E741
    dense = plan_dense(ck, fam, spec, fam.resolve_config(cfg), names, used, dense_quant)
    try:
        layout = ExpertLayout.build(quant, H, I, biases=fam.experts.biases)
    except StoreError as exc:  # block formats need columns (d_model, d_ff) in their blocks
        raise ConversionError(
            f"{src}: --quant {quant} cannot hold the experts' rows of {H} (gate, up) and {I} "
            f"(down) weights: {exc}"
        ) from None
    total = sum(ck.nbytes(n) for n in ck.meta)
    bar = progress(total, f"convert {src.name}") if show_progress else None
    try:
        with StoreWriter(out, layout, force=force) as w:
            w.begin_dense([(store, qt, shape) for _, store, qt, shape in dense])
            for name, store, qt, shape in dense:
                rows = shape[0] if shape else 1
                step = max(1, _CHUNK_BYTES // max(1, ck.nbytes(name) // rows))
                keep = qt == "fp8" and sw.keeps_fp8(name)  # FP8 bytes kept as they are
                if keep:
                    step = -(-step // FP8_STORE_BLOCK) * FP8_STORE_BLOCK
                for r in range(0, rows, step):
                    n = min(step, rows - r)
                    if keep:
                        w.write_dense(store, sw.fp8_rows(name, r, n))
                        continue
                    x = sw.read(name, r, n) if shape else sw.read(name)
                    w.write_dense(store, quantize(x, qt) if qt != "f32" else x)
                _tick(bar, ck.nbytes(name), 1, len(ck.meta))
            for layer, spec in experts.items():
                for e in range(E):
                    w.write_expert(layer, e, _expert_parts(sw, spec, e, I, quant))
                names = _names(spec)
                names += [sw.scale_of[n] for n in names if n in sw.scale_of]
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
