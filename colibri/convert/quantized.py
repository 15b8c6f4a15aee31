"""Checkpoints the hub ships already quantized: what `quantization_config` says, and the exact
decoders / repackers of their tensors (no engine, numpy only).

FP8 (DeepSeek-V3/R1, Kimi K2, the Qwen3 / GLM / MiniMax FP8 releases): `quant_method` "fp8",
`weight_block_size` [rows, cols] (DeepSeek: [128, 128]), `activation_scheme` "dynamic";
each quantized linear is `X.weight` float8_e4m3fn [rows, cols] with `X.weight_scale_inv` f32
[ceil(rows / br), ceil(cols / bc)], dequantized `weight * scale_inv` block by block (ragged
edge blocks), as DeepSeek's `weight_dequant` and transformers' finegrained_fp8.

MXFP4 (gpt-oss): `quant_method` "mxfp4"; each fused expert tensor `P` of logical
[E, out, in] is `P_blocks` u8 [E, out, in / 32, 16] and `P_scales` u8 E8M0 [E, out, in / 32];
byte j of a 16-byte block holds weight 2j in its low nibble and weight 2j + 1 in its high
nibble, value = FP4_E2M1[nibble] * 2^(scale - 127) (transformers' integrations/mxfp4.py
convert_moe_packed_tensors). GGML's block_mxfp4 (the store's `mxfp4`) is the scale byte then
16 bytes whose byte j holds weight j (low) and weight j + 16 (high), with the same E8M0 byte
(ggml's kvalues_mxfp4 are the doubled E2M1 values, its scale 2^(e - 128)); `mxfp4_to_ggml`
repacks the nibbles, losslessly (llama.cpp's convert_hf_to_gguf.py does the same for gpt-oss).

DeepSeek-V4 (the hub's deepseek-ai/DeepSeek-V4-Flash / -Pro, in the inference repo's own
names: colibri.models.deepseek_v4 SOURCE_RENAMES): `quant_method` "fp8" with
`weight_block_size` [128, 128] and `scale_fmt` "ue8m0", the routed experts FP4 by
`expert_dtype` "fp4" (config.json top level, or inside quantization_config as transformers
5.24 moves it). Each quantized linear's scale is `X.scale` (transformers' FP8 quantizer
renames it `X.weight_scale_inv`), UE8M0 (safetensors F8_E8M0, one byte 2^(b - 127); 255 is
NaN) where V3's were f32. An FP4 expert weight of logical [out, in] is I8 [out, in / 2], byte
j holding weight 2j in its low nibble and 2j + 1 in its high nibble (E2M1), with a UE8M0
scale per 32 weights of a row, [out, in / 32] (the DeepSeek-V4 inference model.py's Linear:
float4_e2m1fn_x2 [out, in // 2], float8_e8m0fnu [out, in // 32]; transformers'
finegrained_fp8 Fp8Dequantize._unpack_fp4 and FP8Experts). Each 16 bytes of a row are so
exactly one gpt-oss MXFP4 block with its scale: `fp4_to_ggml` reuses mxfp4_to_ggml, lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri.errors import ConversionError

FP8_STORE_BLOCK = 128  # the store's fp8 type has 128x128 block scales (io.format.FP8_BLOCK)
# E2M1 values by nibble (sign bit 3), transformers' FP4_VALUES
FP4_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


@dataclass(frozen=True)
class SourceQuant:
    """A checkpoint's `quantization_config`, validated: `method` "fp8" (with `block` = the
    weight_block_size (rows, cols), its `scale_fmt` and the experts' `expert_dtype`) or
    "mxfp4" (with `not_converted` = modules_to_not_convert)."""

    method: str
    block: tuple[int, int] = (0, 0)
    not_converted: tuple[str, ...] = ()
    scale_fmt: str = "float"  # fp8: "float" (f32 / bf16 scales) or "ue8m0" (E8M0 bytes)
    expert_dtype: str = "fp8"  # fp8: the routed experts' format, "fp8" or "fp4" (DeepSeek-V4)


def source_quant(cfg: dict[str, Any], where: Path | str) -> SourceQuant | None:
    """The validated quantization of config.json `cfg` (None when it has no
    `quantization_config`). Raises ConversionError naming the field for a quant_method other
    than fp8 / mxfp4, an fp8 `activation_scheme` other than "dynamic" (static activation
    scales have no place in colibri's kernels), an fp8 `fmt` other than "e4m3", or a
    `weight_block_size` that is not two positive integers."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    field = f"{where}: quantization_config"
    if not isinstance(qc, dict):
        raise ConversionError(f"{field} is not an object")
    method = qc.get("quant_method")
    if method == "mxfp4":
        return SourceQuant("mxfp4", not_converted=tuple(qc.get("modules_to_not_convert") or ()))
    if method != "fp8":
        raise ConversionError(
            f"{field}.quant_method {method!r} is not supported (supported: 'fp8' with "
            "weight_block_size, 'mxfp4'); convert from the unquantized checkpoint instead"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConversionError(
            f"{field}.activation_scheme {scheme!r} is not supported (only 'dynamic': colibri "
            "quantizes activations itself and has no use for static activation scales)"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConversionError(f"{field}.fmt {fmt!r} is not supported (only 'e4m3')")
    block = qc.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ConversionError(
            f"{field}.weight_block_size {block!r} is not supported (need [rows, cols] block "
            "scales, e.g. [128, 128]; per-tensor or per-channel FP8 is not read)"
        )
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ConversionError(f"{field}.scale_fmt {scale_fmt!r} is not supported (float, ue8m0)")
    expert_dtype = qc.get("expert_dtype", cfg.get("expert_dtype")) or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        raise ConversionError(f"{field}.expert_dtype {expert_dtype!r} is not supported (fp8, fp4)")
    return SourceQuant("fp8", (int(block[0]), int(block[1])), (), scale_fmt, expert_dtype)


def e8m0_to_f32(b: np.ndarray) -> np.ndarray:
    """UE8M0 scale bytes (uint8, any shape) -> float32 2^(b - 127), exactly (255: NaN)."""
    b = np.asarray(b, np.uint8)
    out = np.ldexp(np.float32(1.0), b.astype(np.int32) - 127).astype(np.float32)
    return np.where(b == 255, np.float32(np.nan), out)


def e4m3_to_f32(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes (uint8, any shape) -> float32, exactly (a 256-entry table built
    from the format: bias 7, exponent 0 subnormal m / 8 * 2^-6, S.1111.111 NaN, no inf)."""
    return _E4M3_LUT[np.asarray(b, np.uint8)]


def _e4m3_lut() -> np.ndarray:
    b = np.arange(256, dtype=np.uint8)
    e = ((b >> 3) & 15).astype(np.int32)
    m = (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e - 7.0))
    v = np.where((e == 15) & ((b & 7) == 7), np.nan, v)
    return np.where(b & 0x80, -v, v).astype(np.float32)


_E4M3_LUT = _e4m3_lut()


def fp8_dequantize(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], first_row: int = 0
) -> np.ndarray:
    """float32 [rows, cols] = e4m3 `weight` (uint8 [rows, cols], rows first_row.. of the
    tensor) * its blocks' `scale_inv` (f32 [ceil(R / br), ceil(cols / bc)] of the whole
    tensor), the product rounded to f32 as DeepSeek's weight_dequant."""
    br, bc = block
    rows, cols = weight.shape
    srow = scale_inv[(first_row + np.arange(rows)) // br]  # [rows, ncb]
    scale = np.repeat(srow, bc, axis=1)[:, :cols]
    return e4m3_to_f32(weight) * scale.astype(np.float32)


def check_fp8_scale(
    name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int]
) -> None:
    """Raise ConversionError unless `scale_shape` is the block grid of a [rows, cols] weight."""
    want = tuple(-(-d // b) for d, b in zip(shape, block, strict=False))
    if len(shape) != 2 or tuple(scale_shape) != want:
        raise ConversionError(
            f"tensor {name!r}_scale_inv has shape {list(scale_shape)}; weight {list(shape)} with "
            f"weight_block_size {list(block)} needs {list(want)}"
        )


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hub MXFP4 `blocks` u8 [..., G, 16] and `scales` u8 [..., G] -> GGML block_mxfp4 rows
    u8 [..., G * 17] (per block: the E8M0 byte, then byte j = weight j | weight j + 16 << 4).
    Lossless; see the module docstring for both nibble orders."""
    blocks = np.asarray(blocks, np.uint8)
    lo, hi = blocks & 0x0F, blocks >> 4
    w = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # weight order
    qs = w[..., :16] | (w[..., 16:] << 4)
    out = np.concatenate([np.asarray(scales, np.uint8)[..., None], qs], axis=-1)
    return np.ascontiguousarray(out.reshape(*blocks.shape[:-2], -1))


def _fp4_blocks(packed: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    packed = np.asarray(packed).view(np.uint8)
    rows, half = packed.shape
    if half % 16 or np.shape(scales) != (rows, half // 16):
        raise ConversionError(
            f"FP4 weight of {rows} rows x {2 * half} values needs scales [{rows}, "
            f"{2 * half // 32}], got {list(np.shape(scales))}"
        )
    return packed.reshape(rows, half // 16, 16), np.asarray(scales).view(np.uint8)


def fp4_to_ggml(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """DeepSeek-V4 FP4 `packed` (int8 / uint8 [out, in / 2]) and UE8M0 `scales` (uint8
    [out, in / 32]) -> GGML block_mxfp4 rows u8 [out, in / 32 * 17], losslessly (16 bytes of a
    row are one hub MXFP4 block: mxfp4_to_ggml). Raises ConversionError for a scale grid that
    is not one byte per 32 weights of each row."""
    return mxfp4_to_ggml(*_fp4_blocks(packed, scales))


def fp4_dequantize(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """DeepSeek-V4 FP4 `packed` [out, in / 2] with UE8M0 `scales` [out, in / 32] -> float32
    [out, in], exactly (E2M1 value times 2^(scale - 127), as transformers' Fp8Dequantize)."""
    return mxfp4_dequantize(*_fp4_blocks(packed, scales))


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hub MXFP4 `blocks` u8 [..., G, 16], `scales` u8 [..., G] -> float32 [..., G * 32], as
    transformers' convert_moe_packed_tensors (exact: E2M1 values times a power of two)."""
    blocks = np.asarray(blocks, np.uint8)
    w = np.stack([FP4_E2M1[blocks & 0x0F], FP4_E2M1[blocks >> 4]], axis=-1)
    w = w.reshape(*blocks.shape[:-1], 32)
    exp = np.asarray(scales, np.int32) - 127
    out = np.ldexp(w, exp[..., None]).astype(np.float32)
    return out.reshape(*blocks.shape[:-2], -1)
