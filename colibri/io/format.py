"""The store format (docs/FORMAT.md): manifest, dense tensors, expert records.

`open_store(path)` validates a store and returns a `Store`. Nothing here computes (io/ never
imports compute/): dense tensors come back as stored bytes or float32, records as offsets.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from colibri.errors import StoreError

FORMAT_NAME = "colibri-store"
FORMAT_VERSION = 2  # 2: per-tensor qtypes (mixed layouts) and per-layer layouts
READ_VERSIONS = (1, 2)  # version 1 stores (one layout, one qtype) still open
RECORD_ALIGN = 4096  # records start and end on this boundary (O_DIRECT)
TENSOR_ALIGN = 64  # tensors inside a record start on this boundary
MANIFEST = "manifest.json"
CHECKSUM = "xxh3_64"

# qtype name -> (weights per block, bytes per block); GGML's block layouts, byte for byte
QTYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q4_0": (32, 18),  # f16 d, 16 bytes: nibble j = weight j (low), j+16 (high)
    "q4_1": (32, 20),  # f16 d, f16 m, 16 bytes of nibbles as q4_0
    "q8_0": (32, 34),  # f16 d, 32 int8
    # issue 15 (csrc/kquants.h has the field order of each block):
    "q5_0": (32, 22),  # f16 d, u32 qh (5th bits), 16 bytes of low nibbles as q4_0
    "q5_1": (32, 24),  # f16 d, f16 m, u32 qh, 16 bytes of nibbles
    "q2_k": (256, 84),  # 16 bytes of 4-bit scale|min, 64 bytes of 2-bit q, f16 d, f16 dmin
    "q3_k": (256, 110),  # 32 bytes hmask, 64 bytes 2-bit q, 12 bytes 6-bit scales, f16 d
    "q4_k": (256, 144),  # f16 d, f16 dmin, 12 bytes 6-bit scales/mins, 128 bytes nibbles
    "q5_k": (256, 176),  # as q4_k plus 32 bytes of 5th bits before the nibbles
    "q6_k": (256, 210),  # 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d
    "mxfp4": (32, 17),  # e8m0 scale byte, 16 bytes of e2m1 nibbles (GGML's block_mxfp4)
    "iq4_nl": (32, 18),  # f16 d, 16 bytes of nibbles indexing the IQ4_NL value table
    "iq4_xs": (256, 136),  # f16 d, u16 scales_h, 4 bytes scales_l, 128 bytes of nibbles
    # not a GGML type: a row is ceil(cols / 128) f32 scales, then cols float8_e4m3fn bytes
    # (a tensor's 128x128 block scales repeated on each of the block's rows); see row_nbytes
    "fp8": (1, 1),
}
BLOCK_QTYPES = tuple(q for q in QTYPES if q not in ("f32", "f16", "bf16"))  # stored as U8 rows
FP8_BLOCK = 128  # fp8: columns per scale, and rows per scale block of the source tensor
MIXED = "mixed"  # ExpertLayout.qtype when gate, up and down differ
EXPERT_TENSORS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


def row_nbytes(qtype: str, ncols: int) -> int:
    """Bytes of one row of `ncols` weights in `qtype`. Raises StoreError for an unknown qtype
    or a block format whose `ncols` is not a multiple of the block size (32, or 256 for the
    K-quants and iq4_xs; fp8 takes any `ncols`)."""
    if qtype not in QTYPES:
        raise StoreError(f"unknown qtype {qtype!r} (valid: {', '.join(QTYPES)})")
    if qtype == "fp8":
        return 4 * -(-ncols // FP8_BLOCK) + ncols
    block, nbytes = QTYPES[qtype]
    if ncols % block:
        raise StoreError(f"{qtype} needs a multiple of {block} columns, got {ncols}")
    return ncols // block * nbytes


def tensor_nbytes(qtype: str, shape: Iterable[int]) -> int:
    """Bytes of a row-major tensor of logical `shape` (last dim = columns) in `qtype`."""
    shape = list(shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return rows * row_nbytes(qtype, shape[-1])


# safetensors dtype -> numpy dtype of the stored elements (bf16 kept as raw uint16)
_ST_DTYPES = {"U8": np.uint8, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def dense_dtype_shape(qtype: str, shape: Iterable[int]) -> tuple[str, list[int]]:
    """How a dense tensor of logical `shape` in `qtype` is stored in dense.safetensors:
    (safetensors dtype, stored shape). Block formats: U8 [..., row_nbytes]."""
    shape = [int(x) for x in shape]
    if qtype in BLOCK_QTYPES:
        return "U8", [*shape[:-1], row_nbytes(qtype, shape[-1])]
    return {"f32": "F32", "f16": "F16", "bf16": "BF16"}[qtype], shape


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class ExpertRecord:
    """Where one (layer, expert) record lives in the experts file.

    offset, nbytes: bytes, both multiples of RECORD_ALIGN. xxh3: XXH3-64 of the whole record.
    """

    layer: int
    expert: int
    offset: int
    nbytes: int
    xxh3: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor inside an expert record: byte `offset` from the record start (a multiple of
    TENSOR_ALIGN), `nbytes`, logical `shape` ([rows, cols] for weights, [n] for biases)."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    qtype: str


@dataclass(frozen=True)
class ExpertLayout:
    """The layout of a record: `qtype` of the weights (MIXED = "mixed" when gate, up and down
    differ; each tensor's own type is `tensors[name].qtype`), `d_model`, `d_ff` (the expert's
    intermediate size), `record_nbytes` (a multiple of RECORD_ALIGN) and the tensors by name
    (gate, up, down, then optional f32 gate_bias, up_bias, down_bias). A store has one default
    layout and, from version 2, optional per-layer ones (Store.layout_for)."""

    qtype: str
    d_model: int
    d_ff: int
    record_nbytes: int
    tensors: dict[str, TensorSpec] = field(default_factory=dict)

    @property
    def weight_qtypes(self) -> tuple[str, str, str]:
        """(gate, up, down) storage types."""
        return tuple(self.tensors[n].qtype for n in ("gate", "up", "down"))  # type: ignore[return-value]

    @classmethod
    def build(
        cls,
        qtype: str,
        d_model: int,
        d_ff: int,
        biases: bool = False,
        *,
        qtypes: dict[str, str] | None = None,
    ) -> ExpertLayout:
        """The canonical layout: gate [d_ff, d_model], up [d_ff, d_model], down [d_model, d_ff]
        in `qtype` (or per tensor `qtypes[name]`, e.g. {"down": "q6_k"} for a Q4_K_M layer),
        then (if `biases`) f32 gate_bias [d_ff], up_bias [d_ff], down_bias [d_model]; each on
        a TENSOR_ALIGN boundary, the whole padded to RECORD_ALIGN. Raises StoreError for an
        unknown tensor name or qtype, or a shape the qtype's block size does not divide."""
        qtypes = dict(qtypes or {})
        if bad := sorted(set(qtypes) - {"gate", "up", "down"}):
            raise StoreError(f"expert layout: qtypes for unknown tensors {bad}")
        types = {n: qtypes.get(n, qtype) for n in ("gate", "up", "down")}
        shapes: list[tuple[str, tuple[int, ...], str]] = [
            ("gate", (d_ff, d_model), types["gate"]),
            ("up", (d_ff, d_model), types["up"]),
            ("down", (d_model, d_ff), types["down"]),
        ]
        if biases:
            shapes += [
                ("gate_bias", (d_ff,), "f32"),
                ("up_bias", (d_ff,), "f32"),
                ("down_bias", (d_model,), "f32"),
            ]
        tensors, off = {}, 0
        for name, shape, qt in shapes:
            off = align_up(off, TENSOR_ALIGN)
            nb = tensor_nbytes(qt, shape)
            tensors[name] = TensorSpec(off, nb, shape, qt)
            off += nb
        common = types["gate"] if len(set(types.values())) == 1 else MIXED
        return cls(common, d_model, d_ff, align_up(off, RECORD_ALIGN), tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "qtype": self.qtype,
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "record_nbytes": self.record_nbytes,
            "tensors": {
                k: {"offset": t.offset, "nbytes": t.nbytes, "shape": list(t.shape), "qtype": q}
                for k, t in self.tensors.items()
                for q in [t.qtype]
            },
        }


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse a safetensors header: returns ({name: {dtype, shape, data_offsets}}, data start).

    Raises StoreError naming the file if the header is cut short or not JSON, or if a
    tensor's data lies beyond the end of the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StoreError(f"{path}: truncated safetensors file (no header length)")
        (hlen,) = struct.unpack("<Q", head)
        if 8 + hlen > size:
            raise StoreError(f"{path}: truncated safetensors file (header of {hlen} bytes)")
        try:
            header = json.loads(f.read(hlen))
        except ValueError as exc:
            raise StoreError(f"{path}: safetensors header is not valid JSON: {exc}") from None
    header.pop("__metadata__", None)
    start = 8 + hlen
    for name, info in header.items():
        end = start + int(info["data_offsets"][1])
        if end > size:
            raise StoreError(
                f"{path}: truncated: tensor {name!r} ends at byte {end}, file has {size}"
            )
    return header, start


def _need(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise StoreError(f"{where}: missing field {key!r}")
    return d[key]


class Store:
    """An opened, validated store (see docs/FORMAT.md). Use `open_store(path)`.

    Attributes: `path`, `manifest` (dict), `config` (the checkpoint's config dict),
    `model_type`, `layout` (the default ExpertLayout; its record_nbytes is the largest record,
    the slot size), `layouts` ({layer: ExpertLayout} for layers whose layout differs, version
    2; use `layout_for(layer)`), `experts_path`, `records` (all ExpertRecords, layer-major),
    `moe_layers` (sorted layer ids that have experts), `num_experts`.
    """

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        mpath = path / MANIFEST
        self.config: dict[str, Any] = _need(manifest, "config", f"{mpath}")
        self.model_type: str = _need(manifest, "model_type", f"{mpath}")
        self.layout = _parse_layout(_need(manifest, "expert_layout", f"{mpath}"), mpath)
        self.layouts = _parse_layer_layouts(manifest.get("expert_layouts", {}), self.layout, mpath)
        self.experts_path = path / _need(manifest, "experts_file", f"{mpath}")
        self.dense_path = path / manifest.get("dense_file", "dense.safetensors")
        self._dense_meta: dict[str, Any] = _need(manifest, "dense", f"{mpath}")
        self.records: list[ExpertRecord] = _parse_records(manifest, self.layout_for, mpath)
        self._index = {(r.layer, r.expert): r for r in self.records}
        self.moe_layers: list[int] = sorted({r.layer for r in self.records})
        self.num_experts: int = 1 + max((r.expert for r in self.records), default=-1)
        self._check_complete(mpath)
        self._check_experts_file()
        self._dense_header, self._dense_start = self._check_dense_file()

    # ---- validation ---------------------------------------------------------------------

    def _check_complete(self, mpath: Path) -> None:
        for layer in self.moe_layers:
            have = {e for (lay, e) in self._index if lay == layer}
            if len(have) != self.num_experts:
                missing = sorted(set(range(self.num_experts)) - have)
                raise StoreError(f"{mpath}: experts: layer {layer} lacks experts {missing[:8]}")

    def _check_experts_file(self) -> None:
        want = int(self.manifest.get("experts_nbytes", -1))
        if not self.experts_path.is_file():
            raise StoreError(f"{self.experts_path}: experts file missing")
        size = self.experts_path.stat().st_size
        if size != want:
            raise StoreError(
                f"{self.experts_path}: size {size} bytes, manifest experts_nbytes says {want}"
                + (" (file cut short)" if size < want else "")
            )
        end = max((r.offset + r.nbytes for r in self.records), default=0)
        if end > size:
            raise StoreError(f"{self.experts_path}: records extend to byte {end}, file has {size}")

    def _check_dense_file(self) -> tuple[dict[str, Any], int]:
        if not self.dense_path.is_file():
            raise StoreError(f"{self.dense_path}: dense file missing")
        header, start = read_safetensors_header(self.dense_path)
        meta = self._dense_meta
        if set(header) != set(meta):
            extra, missing = sorted(set(header) - set(meta)), sorted(set(meta) - set(header))
            raise StoreError(
                f"{self.dense_path}: tensors differ from manifest 'dense': "
                f"missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, m in meta.items():
            qtype, shape = m.get("qtype"), list(m.get("shape", []))
            if qtype not in QTYPES:
                raise StoreError(f"{self.path / MANIFEST}: dense.{name}.qtype {qtype!r} unknown")
            h = header[name]
            want_dtype, want_shape = dense_dtype_shape(qtype, shape)
            if h["dtype"] != want_dtype or list(h["shape"]) != want_shape:
                raise StoreError(
                    f"{self.dense_path}: tensor {name!r} is {h['dtype']} {h['shape']}, manifest "
                    f"({qtype} {shape}) needs {want_dtype} {want_shape}"
                )
        return header, start

    # ---- access -------------------------------------------------------------------------

    def layout_for(self, layer: int) -> ExpertLayout:
        """The ExpertLayout of `layer`'s records (the default `layout` unless overridden)."""
        return self.layouts.get(layer, self.layout)

    def record(self, layer: int, expert: int) -> ExpertRecord:
        """The record of (`layer`, `expert`); KeyError if the store has none."""
        try:
            return self._index[(layer, expert)]
        except KeyError:
            raise KeyError(f"no expert record for layer {layer}, expert {expert}") from None

    def dense_names(self) -> list[str]:
        """Names of all dense (resident) tensors, HF spelling, in manifest order."""
        return list(self._dense_meta)

    def dense_qtype(self, name: str) -> str:
        return self._dense_meta[name]["qtype"]

    def dense(self, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
        """Load dense tensor `name` (read on demand from dense.safetensors, not mapped).

        Returns (array, qtype, logical shape): for q4_0/q4_1/q8_0 the array is uint8
        [rows, row_nbytes] (the GGML blocks); for f32/f16/bf16 it is float32 in the logical
        shape (f16/bf16 widened exactly). KeyError for an unknown name."""
        if name not in self._dense_meta:
            raise KeyError(f"{self.dense_path}: no dense tensor {name!r}")
        m, h = self._dense_meta[name], self._dense_header[name]
        begin, end = h["data_offsets"]
        with open(self.dense_path, "rb", buffering=0) as f:
            raw = os.pread(f.fileno(), end - begin, self._dense_start + begin)
        if len(raw) != end - begin:
            raise StoreError(f"{self.dense_path}: tensor {name!r} cut short")
        arr = np.frombuffer(raw, dtype=_ST_DTYPES[h["dtype"]]).reshape(h["shape"])
        if h["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        elif h["dtype"] == "F16":
            arr = arr.astype(np.float32)
        else:
            arr = arr.copy()
        return arr, m["qtype"], tuple(m["shape"])

    def verify_record(self, record: ExpertRecord, buffer: Any) -> None:
        """Check `buffer` (the record's `nbytes` bytes, any buffer-protocol object) against
        the record's XXH3-64. Raises StoreError naming layer, expert and offset on mismatch."""
        got = xxhash.xxh3_64_intdigest(buffer)
        if got != record.xxh3:
            raise StoreError(
                f"{self.experts_path}: checksum mismatch in layer {record.layer} expert "
                f"{record.expert} (offset {record.offset}, {record.nbytes} bytes): "
                f"xxh3 {got:016x}, manifest says {record.xxh3:016x}"
            )

    def verify_all(self, progress: Callable[[int], None] | None = None) -> None:
        """Read every record and verify its checksum (sequential buffered reads).

        `progress(nbytes)` is called after each record. Raises StoreError listing the bad
        records (layer, expert) if any checksum does not match."""
        bad: list[str] = []
        with open(self.experts_path, "rb", buffering=0) as f:
            buf = bytearray(self.layout.record_nbytes)
            for r in self.records:
                f.seek(r.offset)
                view = memoryview(buf)[: r.nbytes]
                n = f.readinto(view)
                if n != r.nbytes:
                    raise StoreError(
                        f"{self.experts_path}: short read at layer {r.layer} expert {r.expert}"
                    )
                try:
                    self.verify_record(r, view)
                except StoreError:
                    bad.append(f"{r.layer}/{r.expert}")
                if progress is not None:
                    progress(r.nbytes)
        if bad:
            raise StoreError(
                f"{self.experts_path}: {len(bad)} record(s) fail their xxh3 checksum "
                f"(layer/expert: {', '.join(bad[:10])}{' …' if len(bad) > 10 else ''})"
            )

    def __repr__(self) -> str:
        return (
            f"Store({str(self.path)!r}, {self.model_type}, {len(self.moe_layers)} MoE layers x "
            f"{self.num_experts} experts, {self.layout.qtype})"
        )


def _parse_layout(d: dict[str, Any], mpath: Path, where: str = "") -> ExpertLayout:
    where = where or f"{mpath}: expert_layout"
    try:
        qtype, d_model, d_ff = d["qtype"], int(d["d_model"]), int(d["d_ff"])
        rec = int(d["record_nbytes"])
        raw = d["tensors"]
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{where}: missing or malformed field {exc}") from None
    if qtype not in QTYPES and qtype != MIXED:
        raise StoreError(f"{where}.qtype: unknown qtype {qtype!r}")
    if rec <= 0 or rec % RECORD_ALIGN:
        raise StoreError(f"{where}.record_nbytes {rec} is not a multiple of {RECORD_ALIGN}")
    tensors: dict[str, TensorSpec] = {}
    for name in ("gate", "up", "down"):
        if name not in raw:
            raise StoreError(f"{where}.tensors: missing {name!r}")
    for name, t in raw.items():
        w = f"{where}.tensors.{name}"
        if name not in EXPERT_TENSORS:
            raise StoreError(f"{w}: unknown tensor name (valid: {', '.join(EXPERT_TENSORS)})")
        try:
            spec = TensorSpec(int(t["offset"]), int(t["nbytes"]), tuple(t["shape"]), t["qtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{w}: missing or malformed field {exc}") from None
        if spec.qtype not in QTYPES:
            raise StoreError(f"{w}.qtype: unknown qtype {spec.qtype!r}")
        if name in ("gate", "up", "down") and qtype not in (MIXED, spec.qtype):
            raise StoreError(f"{w}.qtype {spec.qtype!r} differs from the layout's {qtype!r}")
        if spec.offset % TENSOR_ALIGN:
            raise StoreError(f"{w}.offset {spec.offset} is not a multiple of {TENSOR_ALIGN}")
        try:
            want_nb = tensor_nbytes(spec.qtype, spec.shape)
        except StoreError as exc:
            raise StoreError(f"{w}: {exc}") from None
        if spec.nbytes != want_nb:
            raise StoreError(f"{w}.nbytes {spec.nbytes} does not match {spec.qtype} {spec.shape}")
        if spec.offset + spec.nbytes > rec:
            raise StoreError(f"{w} ends at {spec.offset + spec.nbytes} > record_nbytes {rec}")
        tensors[name] = spec
    want = {
        "gate": (d_ff, d_model),
        "up": (d_ff, d_model),
        "down": (d_model, d_ff),
        "gate_bias": (d_ff,),
        "up_bias": (d_ff,),
        "down_bias": (d_model,),
    }
    for name, spec in tensors.items():
        if spec.shape != want[name]:
            raise StoreError(f"{where}.tensors.{name}.shape {list(spec.shape)} != {want[name]}")
    spans = sorted((s.offset, s.offset + s.nbytes, n) for n, s in tensors.items())
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise StoreError(f"{where}.tensors: {a} and {b} overlap")
    return ExpertLayout(qtype, d_model, d_ff, rec, tensors)


def _parse_layer_layouts(raw: Any, default: ExpertLayout, mpath: Path) -> dict[int, ExpertLayout]:
    """manifest "expert_layouts" {"<layer>": layout}: per-layer layouts (version 2), each of
    the default's d_model / d_ff and at most its record_nbytes (the slot size)."""
    where = f"{mpath}: expert_layouts"
    if not isinstance(raw, dict):
        raise StoreError(f"{where}: must be an object of layer -> layout")
    out: dict[int, ExpertLayout] = {}
    for key, d in raw.items():
        try:
            layer = int(key)
        except ValueError:
            raise StoreError(f"{where}: key {key!r} is not a layer number") from None
        lay = _parse_layout(d, mpath, f"{where}.{key}")
        if (lay.d_model, lay.d_ff) != (default.d_model, default.d_ff):
            raise StoreError(
                f"{where}.{key}: d_model/d_ff {lay.d_model}/{lay.d_ff} differ from "
                f"expert_layout's {default.d_model}/{default.d_ff}"
            )
        if lay.record_nbytes > default.record_nbytes:
            raise StoreError(
                f"{where}.{key}.record_nbytes {lay.record_nbytes} exceeds expert_layout's "
                f"{default.record_nbytes} (the default layout must have the largest records)"
            )
        out[layer] = lay
    return out


def plan_layouts(
    per_layer: dict[int, ExpertLayout],
) -> tuple[ExpertLayout, dict[int, ExpertLayout]]:
    """Split the layouts of every MoE layer into (default, overrides) for StoreWriter: the
    default is the layout with the largest records (the most common among those), so no
    record is padded; overrides are the layers whose layout differs from it. Raises
    StoreError for an empty mapping."""
    if not per_layer:
        raise StoreError("plan_layouts: no layers")
    counts: dict[str, int] = {}
    for lay in per_layer.values():
        key = json.dumps(lay.to_json(), sort_keys=True)
        counts[key] = counts.get(key, 0) + 1
    default = max(
        per_layer.values(),
        key=lambda lay: (lay.record_nbytes, counts[json.dumps(lay.to_json(), sort_keys=True)]),
    )
    return default, {k: v for k, v in per_layer.items() if v != default}


def _parse_records(
    manifest: dict[str, Any], layout_for: Callable[[int], ExpertLayout], mpath: Path
) -> list[ExpertRecord]:
    if manifest.get("checksum", CHECKSUM) != CHECKSUM:
        raise StoreError(f"{mpath}: checksum {manifest['checksum']!r} unsupported ({CHECKSUM})")
    records: list[ExpertRecord] = []
    seen: set[tuple[int, int]] = set()
    prev_end = 0
    for i, e in enumerate(_need(manifest, "experts", str(mpath))):
        w = f"{mpath}: experts[{i}]"
        try:
            r = ExpertRecord(
                int(e["layer"]), int(e["expert"]), int(e["offset"]), int(e["nbytes"]),
                int(e["xxh3"], 16),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"{w}: missing or malformed field {exc}") from None
        if r.offset % RECORD_ALIGN:
            raise StoreError(f"{w}.offset {r.offset} is not a multiple of {RECORD_ALIGN}")
        if r.nbytes != (want := layout_for(r.layer).record_nbytes):
            raise StoreError(f"{w}.nbytes {r.nbytes} != record_nbytes {want}")
        if r.offset < prev_end:
            raise StoreError(f"{w}: overlaps the previous record (records must be in order)")
        if (r.layer, r.expert) in seen:
            raise StoreError(f"{w}: duplicate record for layer {r.layer} expert {r.expert}")
        seen.add((r.layer, r.expert))
        prev_end = r.offset + r.nbytes
        records.append(r)
    return records


def open_store(path: str | os.PathLike[str]) -> Store:
    """Open and validate the store at `path` (a directory, see docs/FORMAT.md).

    Checks: manifest present and JSON, format name and version, expert layout (alignment,
    sizes, shapes), every record aligned, in order, non-overlapping and complete per layer,
    the experts file size equal to `experts_nbytes`, and dense.safetensors' header agreeing
    with the manifest. Checksums are verified only by `verify_record` / `verify_all`.
    Raises StoreError naming the file and field at fault."""
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise StoreError(f"{path}: not a store directory")
    if not mpath.is_file():
        raise StoreError(f"{mpath}: missing (not a colibri store?)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as exc:
        raise StoreError(f"{mpath}: not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StoreError(f"{mpath}: field 'format' is not {FORMAT_NAME!r}")
    version = manifest.get("version")
    if version not in READ_VERSIONS:
        raise StoreError(
            f"{mpath}: store version {version!r}, this colibri reads versions "
            f"{', '.join(map(str, READ_VERSIONS))} (a newer colibri wrote it?)"
        )
    if version == 1 and "expert_layouts" in manifest:
        raise StoreError(f"{mpath}: 'expert_layouts' needs store version 2, manifest says 1")
    return Store(path, manifest)


def _check_replaceable(out: Path) -> None:
    """--force replaces only a colibri store or an empty directory, never anything else."""
    if out.is_dir() and not any(out.iterdir()):
        return
    try:
        is_store = json.loads((out / MANIFEST).read_text()).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        is_store = False
    if not is_store:
        raise StoreError(
            f"{out}: exists and is not a colibri store; --force only replaces a store or an "
            "empty directory (choose another OUT)"
        )


class StoreWriter:
    """Writes a store into a temporary directory `OUT.tmp-XXXX` next to `out`, renamed to
    `out` by `finish()`; any exception inside `with StoreWriter(...)` removes it again.

    Order of use: `begin_dense(plan)`, then `write_dense` for each planned tensor in plan
    order, interleaved freely with `write_expert` / `write_record` (records in layer-major,
    expert order), `add_file` for tokenizer files, then `finish(...)`.
    `layouts`: {layer: ExpertLayout} for layers whose records differ from `layout` (mixed
    quants; see plan_layouts), each with record_nbytes <= layout.record_nbytes.
    Raises StoreError if `out` exists and `force` is false, or for an oversized override."""

    def __init__(
        self,
        out: str | os.PathLike[str],
        layout: ExpertLayout,
        *,
        force: bool = False,
        layouts: dict[int, ExpertLayout] | None = None,
    ):
        import tempfile

        self.out = Path(out)
        if self.out.exists() and not force:
            raise StoreError(f"{self.out}: already exists (use --force to replace it)")
        if self.out.exists():
            _check_replaceable(self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.out.name}.tmp-", dir=self.out.parent))
        self.layout = layout
        self.layouts = dict(layouts or {})
        for layer, lay in self.layouts.items():
            if lay.record_nbytes > layout.record_nbytes or (lay.d_model, lay.d_ff) != (
                layout.d_model,
                layout.d_ff,
            ):
                import shutil

                shutil.rmtree(self.tmp, ignore_errors=True)
                raise StoreError(
                    f"layer {layer}: layout of {lay.record_nbytes} bytes (d_model {lay.d_model},"
                    f" d_ff {lay.d_ff}) does not fit the default layout's {layout.record_nbytes}"
                    f" (d_model {layout.d_model}, d_ff {layout.d_ff}); see plan_layouts"
                )
        self.records: list[dict[str, Any]] = []
        self.files: list[str] = []
        self._experts = open(self.tmp / "experts.bin", "wb")  # noqa: SIM115
        self._dense: Any = None
        self._plan: list[tuple[str, str, tuple[int, ...]]] = []
        self._next = 0
        self._written = 0
        self._buf = bytearray(layout.record_nbytes)
        self._buf_layout = layout

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort()

    def begin_dense(self, plan: list[tuple[str, str, tuple[int, ...]]]) -> None:
        """Write dense.safetensors' header for `plan`: (HF name, qtype, logical shape) each."""
        header: dict[str, Any] = {}
        off = 0
        for name, qtype, shape in plan:
            dtype, stored = dense_dtype_shape(qtype, shape)
            nb = int(np.prod(stored, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
            header[name] = {"dtype": dtype, "shape": stored, "data_offsets": [off, off + nb]}
            off += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned
        self._dense = open(self.tmp / "dense.safetensors", "wb")  # noqa: SIM115
        self._dense.write(struct.pack("<Q", len(raw)) + raw)
        self._plan = [(n, q, tuple(int(x) for x in s)) for n, q, s in plan]
        self._header = header

    def write_dense(self, name: str, data: np.ndarray) -> None:
        """Append (a run of leading rows of) the next planned dense tensor: uint8
        [rows, row_nbytes] for block qtypes, float32 / float16 / uint16 (bf16 bits) for
        f32 / f16 / bf16. A tensor may come in several calls; it is done once all its bytes
        are written."""
        if self._next >= len(self._plan) or self._plan[self._next][0] != name:
            raise StoreError(f"dense tensor {name!r} written out of plan order")
        begin, end = self._header[name]["data_offsets"]
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self._written += raw.nbytes
        if self._written > end - begin:
            raise StoreError(f"dense tensor {name!r}: more than the planned {end - begin} bytes")
        self._dense.write(raw.data)
        if self._written == end - begin:
            self._next, self._written = self._next + 1, 0

    def write_expert(self, layer: int, expert: int, parts: dict[str, Any]) -> None:
        """Pack one expert's tensors (name -> bytes-like of exactly the layout's nbytes) into a
        zero-padded record and append it."""
        lay = self.layouts.get(layer, self.layout)
        if lay is not self._buf_layout:  # another layout's tensors may sit in this one's gaps
            self._buf[:] = bytes(len(self._buf))
            self._buf_layout = lay
        buf = memoryview(self._buf)[: lay.record_nbytes]
        for name, spec in lay.tensors.items():
            if name not in parts:
                raise StoreError(f"layer {layer} expert {expert}: tensor {name!r} missing")
            raw = memoryview(np.ascontiguousarray(parts[name])).cast("B")
            if raw.nbytes != spec.nbytes:
                raise StoreError(
                    f"layer {layer} expert {expert}: {name} has {raw.nbytes} bytes, "
                    f"layout needs {spec.nbytes}"
                )
            buf[spec.offset : spec.offset + spec.nbytes] = raw
        self.write_record(layer, expert, buf)

    def write_record(self, layer: int, expert: int, record: Any) -> None:
        """Append one whole record (record_nbytes bytes, padding included)."""
        view = memoryview(record).cast("B")
        want = self.layouts.get(layer, self.layout).record_nbytes
        if view.nbytes != want:
            raise StoreError(f"record {layer}/{expert}: {view.nbytes} bytes, layout needs {want}")
        offset = self._experts.tell()
        self._experts.write(view)
        self.records.append(
            {"layer": layer, "expert": expert, "offset": offset, "nbytes": view.nbytes,
             "xxh3": f"{xxhash.xxh3_64_intdigest(view):016x}"}
        )  # fmt: skip

    def add_file(self, name: str, data: bytes) -> None:
        """Add a side file (tokenizer.json, ...) to the store."""
        (self.tmp / name).write_bytes(data)
        self.files.append(name)

    def finish(self, model_type: str, config: dict[str, Any], source: dict[str, Any]) -> Path:
        """Write manifest.json, sync, and rename the temporary directory to `out` (replacing
        an existing `out` only if `force` was given). Returns `out`."""
        if self._next != len(self._plan):
            raise StoreError(f"dense tensor {self._plan[self._next][0]!r} never written")
        self._experts.flush()
        os.fsync(self._experts.fileno())
        self._experts.close()
        if self._dense is not None:
            self._dense.flush()
            os.fsync(self._dense.fileno())
            self._dense.close()
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model_type": model_type,
            "config": config,
            "source": source,
            "dense_file": "dense.safetensors",
            "dense": {n: {"qtype": q, "shape": list(s)} for n, q, s in self._plan},
            "experts_file": "experts.bin",
            "experts_nbytes": (self.tmp / "experts.bin").stat().st_size,
            "expert_layout": self.layout.to_json(),
            "expert_layouts": {str(k): v.to_json() for k, v in sorted(self.layouts.items())},
            "checksum": CHECKSUM,
            "experts": self.records,
            "tokenizer_files": [f for f in self.files if "token" in f or "template" in f],
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if self.out.exists():
            import shutil

            shutil.rmtree(self.out)
        os.rename(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        """Close and remove the temporary directory (idempotent)."""
        import shutil

        for f in (self._experts, self._dense):
            if f is not None:
                f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- fp8 rows <-> the hub's block-scaled layout (DeepSeek-V3 `weight` + `weight_scale_inv`) ----


def fp8_rows(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """A hub FP8 matrix as the store's fp8 rows, losslessly: `weight` float8_e4m3fn bytes
    (uint8 [rows, cols]) and `scale_inv` f32 [ceil(rows / 128), ceil(cols / 128)] (one scale
    per 128x128 block, ragged edge blocks; dequantized = weight * scale_inv) -> uint8
    [rows, row_nbytes("fp8", cols)]: each row its block row's scales, then its e4m3 bytes.
    Raises StoreError naming the mismatched shape."""
    weight = np.ascontiguousarray(weight).view(np.uint8)
    if weight.ndim != 2:
        raise StoreError(f"fp8 weight must be 2-D [rows, cols], got shape {list(weight.shape)}")
    rows, cols = weight.shape
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    scale_inv = np.asarray(scale_inv, dtype=np.float32)
    if scale_inv.shape != grid:
        raise StoreError(
            f"fp8 weight_scale_inv has shape {list(scale_inv.shape)}, weight {[rows, cols]} "
            f"with {FP8_BLOCK}x{FP8_BLOCK} blocks needs {list(grid)}"
        )
    scales = np.repeat(scale_inv, FP8_BLOCK, axis=0)[:rows]
    return np.concatenate([scales.view(np.uint8), weight], axis=1)


def fp8_unrows(rows_u8: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of fp8_rows: uint8 [rows, row_nbytes("fp8", cols)] -> (weight uint8
    [rows, cols], scale_inv f32 [ceil(rows / 128), ceil(cols / 128)]). Raises StoreError if a
    128-row block's rows do not share their scales (rows not written by fp8_rows)."""
    rows_u8 = np.ascontiguousarray(rows_u8, dtype=np.uint8)
    ns = -(-cols // FP8_BLOCK)
    if rows_u8.ndim != 2 or rows_u8.shape[1] != 4 * ns + cols:
        raise StoreError(
            f"fp8 rows have shape {list(rows_u8.shape)}, {cols} columns need "
            f"[rows, {4 * ns + cols}]"
        )
    scales = rows_u8[:, : 4 * ns].copy().view(np.float32)
    grid = scales[::FP8_BLOCK]
    if not np.array_equal(np.repeat(grid, FP8_BLOCK, axis=0)[: len(scales)].view(np.uint32),
                          scales.view(np.uint32)):  # fmt: skip
        raise StoreError("fp8 rows: rows of one 128-row block carry different scales")
    return rows_u8[:, 4 * ns :].copy(), grid
