"""GGUFs in every GGML type colibri stores (issue 15): K-quants, Q5_0/Q5_1, MXFP4, IQ4_NL/IQ4_XS,
mixed per layer and per tensor as llama.cpp's Q4_K_M and "UD" quants are.

A tiny Mixtral (the real Mixtral tokenizer) is converted to f32 and exported to GGUF; the test
rewrites that GGUF with gguf.GGUFWriter in mixed types (quantized with gguf.quants.quantize or
colibri's ggml-algorithm quantizers; random valid blocks for the import-only types), then:
the store's records are the GGUF's bytes, decode like gguf's dequantizers, run like the
dequantized f32 model, and export-gguf writes the very same tensors back. Where llama.cpp is
built, a real Q4_K_M from its llama-quantize converts and runs like llama.cpp."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402

from colibri.compute import ops, ref  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.export_gguf import export_gguf  # noqa: E402
from colibri.io.format import open_store  # noqa: E402
from tests.test_export_gguf import (  # noqa: E402
    MIXTRAL,
    PROMPT,
    SPM_MODEL,
    _llama_bin,
    _llama_cpp_last_logits,
)

# (gate, up, down) GGML types by layer: Q4_K_M's layer shape, then the rest of the types
LAYER_TYPES = [
    ("Q4_K", "Q4_K", "Q6_K"),
    ("Q5_K", "Q5_0", "Q5_1"),
    ("MXFP4", "IQ4_NL", "IQ4_XS"),
    ("Q2_K", "Q3_K", "Q8_0"),
]
# dense tensors by GGUF name suffix -> type (the rest, norms and routers, stay F32)
DENSE_TYPES = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q6_K", "attn_v.weight": "Q5_1",
               "attn_output.weight": "Q4_K", "token_embd.weight": "Q6_K",
               "output.weight": "Q6_K"}  # fmt: skip
SIZES = dict(MIXTRAL, hidden_size=256, intermediate_size=256, num_hidden_layers=len(LAYER_TYPES))


def _quantize(x: np.ndarray, name: str, rng: np.random.Generator) -> np.ndarray:
    """x float32 [..., cols] -> GGML bytes uint8 [..., row_nbytes] of type `name`."""
    qt = ops.QType[name]
    if int(qt) in ref.GGUF_QUANTIZE:
        return ref.quantize(x, int(qt))
    if qt in ops.QUANTIZE_TYPES:  # K-quants: ggml's reference algorithm (quantize_row_q*_K_ref)
        return ops.quantize(x.reshape(-1, x.shape[-1]), qt).reshape(*x.shape[:-1], -1)
    rows = ref.random_blocks(rng, int(qt), int(np.prod(x.shape[:-1])), x.shape[-1])
    return rows.reshape(*x.shape[:-1], -1)  # import-only types (no quantizer): valid blocks


def _rewrite(src: Path, out: Path, types_of) -> None:
    """Copy GGUF `src` to `out` (metadata verbatim), each tensor re-encoded as `types_of(name)`
    (None: kept as it is) from its f32 values."""
    rng = np.random.default_rng(0)
    r = GGUFReader(src)
    w = GGUFWriter(out, r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        x = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        name = types_of(t.name)
        if name is None or name == "F32":
            w.add_tensor(t.name, np.ascontiguousarray(x, np.float32))
        else:
            w.add_tensor(t.name, _quantize(x.astype(np.float32), name, rng), raw_dtype=T[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _mixed_type(name: str) -> str | None:
    parts = name.split(".")
    if name.endswith("_exps.weight"):
        layer, role = int(parts[1]), parts[2].split("_")[1]
        return LAYER_TYPES[layer][("gate", "up", "down").index(role)]
    return DENSE_TYPES.get(".".join(parts[-2:]))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    """{"f32": colibri's export of the f32 store, "mixed": its mixed-type rewrite,
    "mixed_f32": the mixed GGUF's values as F32} of a tiny Mixtral (real tokenizer)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    if not SPM_MODEL.is_file():
        pytest.skip(f"{SPM_MODEL} absent")
    root = tmp_path_factory.mktemp("kq")
    spm = root / "spm"
    spm.mkdir()
    (spm / "tokenizer.model").write_bytes(SPM_MODEL.read_bytes())
    (spm / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    tok = transformers.AutoTokenizer.from_pretrained(spm, add_bos_token=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**SIZES))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    model.float().save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    convert(root / "hf", root / "f32-store", quant="f32", dense_quant="f32", show_progress=False)
    out = {"hf": root / "hf", "f32": export_gguf(root / "f32-store", root / "f32.gguf")}
    _rewrite(out["f32"], root / "mixed.gguf", _mixed_type)
    _rewrite(root / "mixed.gguf", root / "mixed_f32.gguf", lambda name: None)
    out |= {"mixed": root / "mixed.gguf", "mixed_f32": root / "mixed_f32.gguf"}
    return out


@pytest.fixture(scope="module")
def mixed_store(ggufs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ms") / "mixed"
    return convert(ggufs["mixed"], out, dense_quant="keep", show_progress=False)


def _tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    return {t.name: (t.tensor_type.name, [int(x) for x in t.shape], np.asarray(t.data).tobytes())
            for t in GGUFReader(path).tensors}  # fmt: skip


def test_records_are_the_gguf_bytes_per_layer_types(ggufs, mixed_store):
    store = open_store(mixed_store)
    src = {t.name: t for t in GGUFReader(ggufs["mixed"]).tensors}
    blob = store.experts_path.read_bytes()
    seen = set()
    for layer, types in enumerate(LAYER_TYPES):
        lay = store.layout_for(layer)
        assert lay.weight_qtypes == tuple(t.lower() for t in types)
        for role, tname in zip(("gate", "up", "down"), types, strict=True):
            t = src[f"blk.{layer}.ffn_{role}_exps.weight"]
            data = np.asarray(t.data)  # [E, rows, row_nbytes]
            spec = lay.tensors[role]
            for e in range(store.num_experts):
                rec = store.record(layer, e)
                raw = blob[rec.offset + spec.offset : rec.offset + spec.offset + spec.nbytes]
                assert raw == data[e].tobytes(), (layer, role, e)
            # colibri's decoder == gguf's dequantizer, bit for bit, for every type
            got = ops.dequantize(data[0], tname.lower(), spec.shape)
            want = gguf.quants.dequantize(data[0], t.tensor_type).astype(np.float32)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), tname
            seen.add(tname)
    assert len(seen) == 11  # every type but the GGUF's F32
    # dense tensors kept in their own types (q/k rows un-permuted: same bytes, reordered)
    assert store.dense_qtype("lm_head.weight") == "q6_k"
    assert store.dense_qtype("model.layers.0.self_attn.q_proj.weight") == "q4_k"
    assert store.dense_qtype("model.layers.0.block_sparse_moe.gate.weight") == "f32"


def test_mixed_gguf_round_trips_bit_exact_through_export(ggufs, mixed_store, tmp_path):
    back = export_gguf(mixed_store, tmp_path / "back.gguf")
    want, got = _tensors(ggufs["mixed"]), _tensors(back)
    assert set(got) == set(want)
    for name, (tname, shape, data) in want.items():
        assert got[name][:2] == (tname, shape), name
        assert got[name][2] == data, name
    # and again: GGUF -> store -> GGUF is a fixed point, store records included
    again = open_store(convert(back, tmp_path / "again", dense_quant="keep", show_progress=False))
    first = open_store(mixed_store)
    assert [r.xxh3 for r in again.records] == [r.xxh3 for r in first.records]


def _logits(store: Path, ids: list[int], activations: str = "f32") -> np.ndarray:
    from tests import hf_models

    return asyncio.run(hf_models.engine_greedy(store, ids, 8, activations=activations))[1]


def test_mixed_store_runs_as_its_dequantized_twin(ggufs, mixed_store, tmp_path):
    """The mixed-type store and the store of the same values in F32 give the same logits
    (f32 activations: the kernels decode every type exactly)."""
    twin = convert(ggufs["mixed_f32"], tmp_path / "f32", dense_quant="f32", show_progress=False)
    assert open_store(twin).layout.qtype == "f32"
    ids = [1, 415, 2936, 9060, 285, 1142, 28713, 754, 272, 17898, 3914, 28723]
    a, b = _logits(mixed_store, ids), _logits(twin, ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def test_llama_quantize_q4_k_m_converts_and_runs_like_llama_cpp(ggufs, tmp_path):
    """llama.cpp's own Q4_K_M (Q6_K on some layers' ffn_down_exps, Q6_K output): converted
    byte-exact with per-layer layouts and exported back identically; with f32 activations
    colibri's logits equal those of the dequantized F32 twin (as llama.cpp's on the twin do);
    with Q8_0 activations colibri is no further from exact than llama.cpp with its Q8_K."""
    import subprocess

    exe = _llama_bin() / "llama-quantize"
    if not exe.is_file():
        pytest.skip(f"{exe} missing")
    q4km = tmp_path / "q4km.gguf"
    res = subprocess.run([str(exe), str(ggufs["f32"]), str(q4km), "Q4_K_M", "1"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    types = {t.name: t.tensor_type.name for t in GGUFReader(q4km).tensors}
    downs = {types[f"blk.{i}.ffn_down_exps.weight"] for i in range(len(LAYER_TYPES))}
    assert downs == {"Q4_K", "Q6_K"}  # mixed per layer, as the issue says
    store = convert(q4km, tmp_path / "s", dense_quant="keep", show_progress=False)
    st = open_store(store)
    assert {st.layout_for(i).weight_qtypes[2] for i in st.moe_layers} == {"q4_k", "q6_k"}
    back = export_gguf(store, tmp_path / "back.gguf")
    assert _tensors(back) == _tensors(q4km)
    ids, want = _llama_cpp_last_logits(q4km, PROMPT, tmp_path / "out")
    _rewrite(q4km, tmp_path / "twin.gguf", lambda name: None)
    twin = convert(tmp_path / "twin.gguf", tmp_path / "t", dense_quant="f32", show_progress=False)
    exact, twin_l = _logits(store, ids)[0], _logits(twin, ids)[0]
    scale = np.abs(twin_l).max()
    assert np.abs(exact - twin_l).max() <= 1e-4 * scale  # colibri decodes Q4_K_M exactly
    ids_t, llama_twin = _llama_cpp_last_logits(tmp_path / "twin.gguf", PROMPT, tmp_path / "o2")
    assert ids_t == ids
    assert np.abs(llama_twin - twin_l).max() <= 1e-4 * scale  # same f32 weights, same logits
    # quantized activations: llama.cpp rounds them to Q8_K for K-quant matmuls, colibri to
    # Q8_0; each engine's distance from the exact logits, and from each other
    q8 = _logits(store, ids, "q8_0")[0]
    e_llama = np.abs(want - exact).max() / scale
    e_ours = np.abs(q8 - exact).max() / scale
    e_both = np.abs(q8 - want).max() / scale
    print(f"Q4_K_M vs exact: llama.cpp {e_llama:.2e}, colibri q8_0 {e_ours:.2e}; "
          f"colibri vs llama.cpp {e_both:.2e}")  # fmt: skip
    assert e_ours <= max(1.5 * e_llama, 1e-2) and e_both <= e_llama + e_ours + 1e-6
    # the default, q8_k (Q8_K activations for the K-quant matrices, as llama.cpp): as close
    e_k = np.abs(_logits(store, ids, "q8_k")[0] - exact).max() / scale
    print(f"colibri q8_k vs exact {e_k:.2e}")
    assert e_k <= max(1.5 * e_llama, 1e-2)
