"""The store format: StoreWriter -> open_store round trip, and every validation failure named."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import xxhash

from colibri.cli import main
from colibri.errors import StoreError
from colibri.io.format import (
    BLOCK_QTYPES,
    RECORD_ALIGN,
    TENSOR_ALIGN,
    ExpertLayout,
    StoreWriter,
    open_store,
    row_nbytes,
)

D_MODEL, D_FF, LAYERS, EXPERTS = 64, 96, (1, 2), 3


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits by truncation (the test's values are exactly representable)."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def make_store(path, *, biases=False, seed=0):
    """A small store with random records and one dense tensor of each storage type; returns
    (path, {(layer, expert): record bytes}, {name: expected Store.dense() array})."""
    rng = np.random.default_rng(seed)
    layout = ExpertLayout.build("q4_0", D_MODEL, D_FF, biases=biases)
    f32 = rng.standard_normal((5, 64)).astype(np.float32)
    bf = (rng.standard_normal(64).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    f16 = rng.standard_normal((2, 32)).astype(np.float16)
    q8 = rng.integers(0, 255, (4, row_nbytes("q8_0", 64)), dtype=np.uint8)
    plan = [
        ("model.embed_tokens.weight", "q8_0", (4, 64)),
        ("model.layers.1.mlp.gate.weight", "f32", (5, 64)),
        ("model.norm.weight", "bf16", (64,)),
        ("lm_head.weight", "f16", (2, 32)),
    ]
    records = {}
    with StoreWriter(path, layout) as w:
        w.begin_dense(plan)
        w.write_dense("model.embed_tokens.weight", q8[:3])  # in two pieces
        w.write_dense("model.embed_tokens.weight", q8[3:])
        w.write_dense("model.layers.1.mlp.gate.weight", f32)
        w.write_dense("model.norm.weight", bf16_bits(bf))
        w.write_dense("lm_head.weight", f16)
        for layer in LAYERS:
            for e in range(EXPERTS):
                parts = {k: rng.bytes(t.nbytes) for k, t in layout.tensors.items()}
                w.write_expert(layer, e, parts)
                buf = bytearray(layout.record_nbytes)
                for k, t in layout.tensors.items():
                    buf[t.offset : t.offset + t.nbytes] = parts[k]
                records[(layer, e)] = bytes(buf)
        w.add_file("tokenizer.json", b"{}")
        cfg = {"num_hidden_layers": 3, "hidden_size": D_MODEL, "num_attention_heads": 4}
        w.finish("qwen3_moe", cfg | {"num_experts_per_tok": 2}, {"kind": "t"})
    dense = {
        "model.embed_tokens.weight": q8,
        "model.layers.1.mlp.gate.weight": f32,
        "model.norm.weight": bf,
        "lm_head.weight": f16.astype(np.float32),
    }
    return path, records, dense


def test_round_trip(tmp_path):
    path, records, dense = make_store(tmp_path / "s")
    s = open_store(path)
    assert s.model_type == "qwen3_moe" and s.config["num_experts_per_tok"] == 2
    assert s.moe_layers == list(LAYERS) and s.num_experts == EXPERTS
    assert s.layout.d_model == D_MODEL and s.layout.d_ff == D_FF
    assert s.layout.record_nbytes % RECORD_ALIGN == 0
    assert all(t.offset % TENSOR_ALIGN == 0 for t in s.layout.tensors.values())
    assert s.layout.tensors["down"].shape == (D_MODEL, D_FF)
    blob = s.experts_path.read_bytes()
    assert len(blob) == len(records) * s.layout.record_nbytes
    for (layer, e), want in records.items():
        r = s.record(layer, e)
        assert r.offset % RECORD_ALIGN == 0
        assert blob[r.offset : r.offset + r.nbytes] == want
        assert r.xxh3 == xxhash.xxh3_64_intdigest(want)
        s.verify_record(r, want)
    s.verify_all()
    assert s.dense_names() == list(dense)
    for name, want in dense.items():
        arr, qtype, _shape = s.dense(name)
        assert arr.dtype == (np.uint8 if qtype == "q8_0" else np.float32)
        np.testing.assert_array_equal(arr, want)
    assert s.manifest["tokenizer_files"] == ["tokenizer.json"]
    with pytest.raises(KeyError):
        s.record(0, 0)


def test_dense_tensor_read_in_pieces(tmp_path, monkeypatch):
    """A read returns at most ~2 GiB (Linux), so a big dense tensor (a bf16 embedding of a
    large vocabulary) arrives in several: here every read is cut to 1,000 bytes."""
    import colibri.io.format as fmt

    path, _records, dense = make_store(tmp_path / "s")
    real = os.preadv
    calls = []

    def short_preadv(fd, buffers, offset):
        calls.append(offset)
        return real(fd, [memoryview(buffers[0]).cast("B")[:1000]], offset)

    monkeypatch.setattr(fmt.os, "preadv", short_preadv)
    s = open_store(path)
    for name, want in dense.items():
        np.testing.assert_array_equal(s.dense(name)[0], want)
    assert len(calls) > len(dense)


def test_gpt_oss_style_biases_layout():
    lay = ExpertLayout.build("q8_0", 2880, 2880, biases=True)
    assert list(lay.tensors) == ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
    assert lay.tensors["down_bias"].shape == (2880,) and lay.tensors["gate_bias"].qtype == "f32"
    ends = [t.offset + t.nbytes for t in lay.tensors.values()]
    assert max(ends) <= lay.record_nbytes < max(ends) + RECORD_ALIGN


def test_cut_short_and_flipped_byte(tmp_path):
    path, _records, _ = make_store(tmp_path / "s")
    s = open_store(path)
    rec = s.record(2, 1)
    with open(s.experts_path, "r+b") as f:  # flip one byte inside layer 2 expert 1
        f.seek(rec.offset + 100)
        b = f.read(1)
        f.seek(rec.offset + 100)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(StoreError, match=r"experts\.bin: 1 record\(s\) fail .*layer/expert: 2/1"):
        open_store(path).verify_all()
    bad = s.experts_path.read_bytes()[rec.offset : rec.offset + rec.nbytes]
    with pytest.raises(StoreError, match=r"checksum mismatch in layer 2 expert 1"):
        s.verify_record(rec, bad)
    assert main(["inspect", str(path), "--verify"]) == 1
    assert main(["inspect", str(path)]) == 0
    with open(s.experts_path, "r+b") as f:
        f.truncate(rec.offset)
    with pytest.raises(StoreError, match=r"experts\.bin: size \d+ bytes, .* \(file cut short\)"):
        open_store(path)
    assert main(["inspect", str(path)]) == 1


def _edit_manifest(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (lambda m: m.update(version=3), r"store version 3, this colibri reads versions 1, 2"),
        (lambda m: m.update(format="x"), r"manifest\.json: field 'format'"),
        (lambda m: m.pop("expert_layout"), r"manifest\.json: missing field 'expert_layout'"),
        (lambda m: m["experts"][1].update(offset=100), r"experts\[1\]\.offset 100 is not a"),
        (lambda m: m["experts"][1].update(nbytes=8192), r"experts\[1\]\.nbytes 8192 != record"),
        (lambda m: m["experts"].pop(4), r"experts: layer 2 lacks experts \[1\]"),
        (lambda m: m["experts"][2].update(expert=0), r"experts\[2\]: duplicate record"),
        (lambda m: m["experts"][0].pop("xxh3"), r"experts\[0\]: missing or malformed field"),
        (lambda m: m.update(experts_nbytes=1), r"experts\.bin: size \d+ bytes, manifest .* 1$"),
        (
            lambda m: m["expert_layout"]["tensors"]["up"].update(offset=1153),
            r"expert_layout\.tensors\.up\.offset 1153 is not a multiple of 64",
        ),
        (
            lambda m: m["expert_layout"]["tensors"]["down"].update(shape=[96, 64]),
            r"expert_layout\.tensors\.down\.nbytes|tensors\.down\.shape",
        ),
        (lambda m: m["expert_layout"].update(qtype="q7_k"), r"expert_layout\.qtype: unknown"),
        (
            lambda m: m["dense"]["model.norm.weight"].update(shape=[32]),
            r"dense\.safetensors: tensor 'model\.norm\.weight' is BF16 \[64\], manifest",
        ),
        (lambda m: m["dense"].pop("lm_head.weight"), r"differ from manifest 'dense'"),
        (
            lambda m: m["dense"]["lm_head.weight"].update(qtype="q8_0", shape=[8, 191]),
            r"manifest\.json: dense\.lm_head\.weight\.shape \[8, 191\]: q8_0 needs a multiple",
        ),
    ],
)
def test_manifest_errors_name_the_field(tmp_path, edit, pattern):
    path, _, _ = make_store(tmp_path / "s")
    _edit_manifest(path, edit)
    with pytest.raises(StoreError, match=pattern):
        open_store(path)


def test_missing_and_truncated_files(tmp_path):
    path, _, _ = make_store(tmp_path / "s")
    with pytest.raises(StoreError, match="not a store directory"):
        open_store(tmp_path / "nope")
    dense = path / "dense.safetensors"
    data = dense.read_bytes()
    dense.write_bytes(data[:-10])
    with pytest.raises(StoreError, match=r"dense\.safetensors: truncated: tensor 'lm_head"):
        open_store(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match=r"manifest\.json: not valid JSON"):
        open_store(path)
    (path / "manifest.json").unlink()
    with pytest.raises(StoreError, match=r"manifest\.json: missing"):
        open_store(path)


def test_writer_refuses_existing_and_cleans_up(tmp_path):
    path, _, _ = make_store(tmp_path / "s")
    lay = ExpertLayout.build("q4_0", D_MODEL, D_FF)
    with pytest.raises(StoreError, match="already exists"):
        StoreWriter(path, lay)
    with pytest.raises(RuntimeError), StoreWriter(path, lay, force=True) as w:
        w.begin_dense([])
        raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    open_store(path)  # the old store is untouched
    with (
        pytest.raises(StoreError, match="out of plan order"),
        StoreWriter(tmp_path / "t", lay) as w,
    ):
        w.begin_dense([("a", "f32", (2,)), ("b", "f32", (2,))])
        w.write_dense("b", np.zeros(2, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    shutil.rmtree(path)


def test_synthetic_store_is_valid_and_small_valued(tmp_path):
    """tools/synth_store.py: a 1-layer OLMoE-shaped store (8 of 64 experts) opens, verifies,
    has the real shapes, and its random blocks decode to finite weights within the bound."""
    gguf = pytest.importorskip("gguf")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from synth_store import synth_store

    out = synth_store("olmoe-1b-7b", tmp_path / "s", layers=1, scale=0.125, show_progress=False)
    s = open_store(out)
    s.verify_all()
    assert s.model_type == "olmoe" and s.num_experts == 8 and s.moe_layers == [0]
    assert (s.layout.d_model, s.layout.d_ff) == (2048, 1024)
    assert s.dense("model.embed_tokens.weight")[2] == (50304, 2048)
    rec = s.record(0, 5)
    with open(s.experts_path, "rb") as f:
        f.seek(rec.offset)
        raw = f.read(rec.nbytes)
    t = s.layout.tensors["down"]
    w = gguf.quants.dequantize(
        np.frombuffer(raw[t.offset : t.offset + t.nbytes], np.uint8).reshape(t.shape[0], -1),
        gguf.GGMLQuantizationType.Q4_0,
    )
    assert w.shape == t.shape and np.isfinite(w).all()
    dmax = float(np.float16(3e-3))  # largest scale the generator draws, in f16
    assert 0.001 < np.abs(w).max() <= 8 * dmax
    q8, qtype, _ = s.dense("model.layers.0.self_attn.q_proj.weight")
    wq = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    assert qtype == "q8_0" and np.isfinite(wq).all() and np.abs(wq).max() <= 128 * dmax


def _synth():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import synth_store

    return synth_store


def _dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """gguf's dequantizer (colibri's fp8 reference for fp8, which GGML lacks)."""
    gguf = pytest.importorskip("gguf")
    from colibri.compute import ref

    if qtype == "fp8":
        return ref.fp8_dequantize(raw, shape)
    w = gguf.quants.dequantize(raw.reshape(shape[0], -1), gguf.GGMLQuantizationType[qtype.upper()])
    return w.reshape(shape)


@pytest.mark.parametrize("qtype", BLOCK_QTYPES)
def test_synthetic_blocks_are_valid_for_every_type(qtype):
    """tools/synth_store.py's random rows of every block type decode (gguf's dequantizers) to
    finite, small, roughly zero-centred weights, also when taken from a pool at a row
    boundary that is not the pool's first."""
    synth = _synth()
    rng = np.random.default_rng(1)
    cols = 640 if qtype == "fp8" else 512  # fp8: a ragged 128-column scale block
    w = _dequantize(synth.random_rows(qtype, 64, cols, rng), qtype, (64, cols))
    assert np.isfinite(w).all()
    assert 1e-3 < np.abs(w).max() < 0.5, np.abs(w).max()
    assert abs(w.mean()) < 0.2 * w.std(), (w.mean(), w.std())
    pool = synth.BlockPool(qtype, 1 << 16, rng, cols)
    for _ in range(4):
        raw = np.frombuffer(pool.take(3 * pool.unit), np.uint8)
        assert np.isfinite(_dequantize(raw, qtype, (3, cols))).all()


@pytest.mark.parametrize(("quant", "dense_quant"), [("q4_k", "q6_k"), ("fp8", "fp8")])
def test_synthetic_store_of_new_types_decodes(tmp_path, quant, dense_quant):
    """A 1-layer OLMoE-shaped synthetic store in a K-quant / fp8: every tensor of an expert
    record and a dense projection decode to finite weights within the generator's bound."""
    out = _synth().synth_store(
        "olmoe-1b-7b", tmp_path / "s", quant=quant, dense_quant=dense_quant, layers=1,
        scale=0.125, show_progress=False,
    )  # fmt: skip
    s = open_store(out)
    s.verify_all()
    rec = s.record(0, 3)
    with open(s.experts_path, "rb") as f:
        f.seek(rec.offset)
        raw = np.frombuffer(f.read(rec.nbytes), np.uint8)
    for t in s.layout.tensors.values():
        assert t.qtype == quant
        w = _dequantize(raw[t.offset : t.offset + t.nbytes], quant, t.shape)
        assert np.isfinite(w).all() and 1e-3 < np.abs(w).max() < 0.5
    data, qtype, shape = s.dense("model.layers.0.self_attn.o_proj.weight")
    assert qtype == dense_quant
    w = _dequantize(np.ascontiguousarray(data), qtype, shape)
    assert np.isfinite(w).all() and np.abs(w).max() < 0.5


def test_synthetic_routing_reproduces_real_expert_popularity():
    """tools/synth_store.py --routing: routing_popularity reads OLMoE's real per-expert counts
    (top-8 shares summing to 8, store layers mapped to the counted layers 0 / 7 / 15 by depth)
    and calibrate_router's router, on fresh hidden states of the same kind, picks each expert
    (numpy top-k) at its real share, where the random router it started from does not."""
    synth = _synth()
    if not (synth.ROUTING_STATS / "expert_counts" / "arxiv.json.gz").is_file():
        pytest.skip(f"routing statistics absent: {synth.ROUTING_STATS}")
    pop = synth.routing_popularity("arxiv", 4)
    assert pop.shape == (4, 64) and np.allclose(pop.sum(axis=1), 8.0)
    assert np.array_equal(pop[1], pop[2]) and not np.array_equal(pop[0], pop[3])  # 7, 7 / 0, 15
    with pytest.raises(SystemExit, match="must be one of"):
        synth.routing_popularity("nope", 2)
    rng = np.random.default_rng(3)

    def hidden(n: int) -> np.ndarray:  # block 0 the shared constant, the rest token noise
        h = rng.standard_normal((n, 2048)).astype(np.float32)
        h[:, :32] = 2.7 + 0.05 * rng.standard_normal((n, 32))
        return h

    w0 = (0.02 * rng.standard_normal((64, 2048))).astype(np.float32)
    w, err = synth.calibrate_router(w0.copy(), hidden(4000), pop[3], 8)

    def shares(w: np.ndarray, h: np.ndarray) -> np.ndarray:
        top = np.argsort(-(h @ w.T), axis=1, kind="stable")[:, :8]
        return np.bincount(top.ravel(), minlength=64) / len(h)

    test = hidden(4000)
    got, before = shares(w, test), shares(w0, test)
    assert err < 0.01
    assert np.abs(got - pop[3]).mean() < 0.02, np.abs(got - pop[3]).mean()
    assert np.abs(before - pop[3]).mean() > 0.05
    assert got.max() > 0.8 and abs(got.max() - pop[3].max()) < 0.05


def test_manifest_model_type_must_name_the_configs_family(tmp_path, capsys):
    from colibri.registry import store_spec

    path, _, _ = make_store(tmp_path / "s")
    assert store_spec(open_store(path)).model_type == "qwen3_moe"
    _edit_manifest(path, lambda m: m["config"].update(model_type="mixtral"))
    want = r"manifest\.json: model_type 'qwen3_moe' but config\.model_type 'mixtral'"
    with pytest.raises(StoreError, match=want):
        store_spec(open_store(path))
    assert main(["run", str(path), "-n", "1"]) == 1
    assert "the two must name the same family" in capsys.readouterr().err  # the engine checks
