"""Store format v2 (per-tensor qtypes, per-layer expert layouts) end to end, and its
validation: a tiny Mixtral converted to f32 is requantized into a store whose every MoE layer
has other expert types (q5_0/q5_1/q4_0, mxfp4, fp8/q8_0) and whose dense tensors use the new
types too (fp8 embeddings and attention, q5_1 output head); the engine on it must give the
logits of the engine on an f32 store holding gguf's / numpy's dequantization of exactly those
bytes (f32 activations), and tokens of the same greedy run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibri.compute import ops, ref
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import StoreError
from colibri.io.format import ExpertLayout, StoreWriter, open_store, plan_layouts
from tests import hf_models

LAYER_TYPES = {  # MoE layer -> (gate, up, down)
    0: ("q5_0", "q5_1", "q4_0"),
    1: ("mxfp4", "mxfp4", "mxfp4"),
    2: ("fp8", "fp8", "q8_0"),
}
DENSE_TYPES = {  # dense tensor (suffix) -> qtype; the rest stay f32
    "embed_tokens.weight": "fp8",
    "self_attn.q_proj.weight": "fp8",
    "self_attn.o_proj.weight": "q5_0",
    "lm_head.weight": "q5_1",
}


def _dense_type(name: str) -> str:
    return next((q for k, q in DENSE_TYPES.items() if name.endswith(k)), "f32")


def _requantize(src_store, out_mixed, out_deq):
    """Two stores from an f32 store: `out_mixed` with LAYER_TYPES / DENSE_TYPES, `out_deq`
    all f32 holding the reference dequantization of out_mixed's bytes."""
    s = open_store(src_store)
    lay = s.layout
    per_layer = {
        layer: ExpertLayout.build(
            "f32",
            lay.d_model,
            lay.d_ff,
            qtypes=dict(zip(("gate", "up", "down"), LAYER_TYPES[layer], strict=True)),
        )
        for layer in s.moe_layers
    }
    default, overrides = plan_layouts(per_layer)
    plan_mixed, plan_f32, dense_q, dense_f = [], [], {}, {}
    for name in s.dense_names():
        arr, _q, shape = s.dense(name)
        qt = _dense_type(name)
        if qt == "f32":
            dense_q[name] = dense_f[name] = arr
        else:
            dense_q[name] = ops.quantize(arr, qt)
            dense_f[name] = ref.dequantize(dense_q[name], int(ops.QType.parse(qt)), shape)
        plan_mixed.append((name, qt, shape))
        plan_f32.append((name, "f32", shape))
    files = [
        p
        for p in s.path.iterdir()
        if p.name not in ("manifest.json", "dense.safetensors", "experts.bin")
    ]
    blob = s.experts_path.read_bytes()
    with StoreWriter(out_mixed, default, layouts=overrides) as wq, StoreWriter(out_deq, lay) as wf:
        wq.begin_dense(plan_mixed)
        wf.begin_dense(plan_f32)
        for name, _q, _s in plan_mixed:
            wq.write_dense(name, dense_q[name])
            wf.write_dense(name, dense_f[name])
        for r in s.records:
            rec = blob[r.offset : r.offset + r.nbytes]
            target = wq.layouts.get(r.layer, wq.layout)
            parts_q, parts_f = {}, {}
            for part, spec in lay.tensors.items():
                w = np.frombuffer(rec[spec.offset : spec.offset + spec.nbytes], np.float32)
                w = w.reshape(spec.shape)
                qt = target.tensors[part].qtype
                parts_q[part] = ops.quantize(w, qt)
                parts_f[part] = ref.dequantize(parts_q[part], int(ops.QType.parse(qt)), w.shape)
            wq.write_expert(r.layer, r.expert, parts_q)
            wf.write_expert(r.layer, r.expert, parts_f)
        for p in files:
            wq.add_file(p.name, p.read_bytes())
            wf.add_file(p.name, p.read_bytes())
        wq.finish(s.model_type, s.config, {"kind": "test"})
        wf.finish(s.model_type, s.config, {"kind": "test"})


async def test_mixed_store_matches_dequantized_f32(tmp_path):
    model = hf_models.build("mixtral", seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    convert(src, tmp_path / "f32", quant="f32", dense_quant="f32")
    _requantize(tmp_path / "f32", tmp_path / "mixed", tmp_path / "deq")
    s = open_store(tmp_path / "mixed")
    assert s.manifest["version"] == 2
    assert {layer: s.layout_for(layer).weight_qtypes for layer in s.moe_layers} == LAYER_TYPES
    assert s.layout_for(0).qtype == "mixed" and s.layout_for(1).qtype == "mxfp4"
    sizes = {layer: s.layout_for(layer).record_nbytes for layer in s.moe_layers}
    assert s.layout.record_nbytes == max(sizes.values())
    assert all(r.nbytes == sizes[r.layer] for r in s.records)
    s.verify_all()
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, 24).tolist()
    tokens, logits = await hf_models.engine_greedy(tmp_path / "mixed", ids, 12, activations="f32")
    async with open_engine(tmp_path / "deq", activations="f32") as engine:
        seq = engine.new_sequence()
        want = [await engine.forward(seq, ids)]
        for tok in tokens[:-1]:
            want.append(await engine.forward(seq, [tok]))
    want = np.stack(want)
    assert np.abs(logits - want).max() <= 1e-4 * np.abs(want).max()
    # and on Q8_0 activations every type runs (integer dots), close to the f32 run
    q_tokens, q_logits = await hf_models.engine_greedy(tmp_path / "mixed", ids, 12)
    assert np.isfinite(q_logits).all() and q_tokens[0] == tokens[0]


def _config(layers: int) -> dict:
    """The fields every store's config needs (io/config.py), the rest left to defaults."""
    return {"hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4}


def _v2_store(tmp_path):
    lay = ExpertLayout.build("q4_0", 64, 96)
    small = ExpertLayout.build("q4_0", 64, 96, qtypes={"down": "q8_0"})
    big = ExpertLayout.build("q8_0", 64, 96)
    default, over = plan_layouts({0: lay, 1: small, 2: big, 3: lay})
    assert default == big and set(over) == {0, 1, 3}
    with StoreWriter(tmp_path / "s", default, layouts=over) as w:
        w.begin_dense([])
        for layer in range(4):
            target = w.layouts.get(layer, w.layout)
            w.write_expert(layer, 0, {k: bytes(t.nbytes) for k, t in target.tensors.items()})
        w.finish("mixtral", _config(4), {"kind": "test"})
    return tmp_path / "s"


def _edit(path, fn):
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_version_1_still_opens_and_v2_fields_are_validated(tmp_path):
    path = _v2_store(tmp_path)
    s = open_store(path)
    assert s.layout_for(1).weight_qtypes == ("q4_0", "q4_0", "q8_0")
    assert s.layout_for(2) is s.layout
    # a version-1 manifest (one layout, no expert_layouts) opens as before
    _edit(path, lambda m: m.update(version=1))
    with pytest.raises(StoreError, match="'expert_layouts' needs store version 2"):
        open_store(path)
    with pytest.raises(StoreError, match=r"experts\[0\]\.nbytes \d+ != record_nbytes"):
        _edit(path, lambda m: m.pop("expert_layouts"))
        open_store(path)
    _edit(path, lambda m: m.update(version=2))
    m0 = json.loads((path / "manifest.json").read_text())
    uniform = tmp_path / "u"
    with StoreWriter(uniform, ExpertLayout.build("q4_0", 64, 96)) as w:
        w.begin_dense([])
        w.write_expert(0, 0, {k: bytes(t.nbytes) for k, t in w.layout.tensors.items()})
        w.finish("mixtral", _config(1), {"kind": "test"})
    _edit(uniform, lambda m: (m.update(version=1), m.pop("expert_layouts")))
    assert open_store(uniform).layout_for(0).weight_qtypes == ("q4_0",) * 3
    for fn, msg in [
        (lambda m: m.update(version=3), "store version 3, this colibri reads versions 1, 2"),
        (
            lambda m: m.update(expert_layouts={"0": m["expert_layout"] | {"d_ff": 32}}),
            r"expert_layouts\.0",
        ),
        (
            lambda m: m["expert_layout"]["tensors"]["down"].update(qtype="q4_0"),
            r"expert_layout\.tensors\.down\.qtype 'q4_0' differs|nbytes",
        ),
        (
            lambda m: m.update(expert_layouts={"x": m["expert_layout"]}),
            r"expert_layouts: key 'x' is not a layer number",
        ),
    ]:
        m = json.loads(json.dumps(m0))
        fn(m)
        (path / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(StoreError, match=msg):
            open_store(path)


def test_writer_refuses_an_override_larger_than_the_default(tmp_path):
    small, big = ExpertLayout.build("q4_0", 64, 96), ExpertLayout.build("q8_0", 64, 96)
    with pytest.raises(StoreError, match=r"layer 1: layout of .* does not fit"):
        StoreWriter(tmp_path / "s", small, layouts={1: big})
    assert not list(tmp_path.iterdir())  # the temporary directory is gone
    with pytest.raises(StoreError, match="qtypes for unknown tensors"):
        ExpertLayout.build("q4_0", 64, 96, qtypes={"gate_bias": "q8_0"})


def _kl_top1(ref_logits: np.ndarray, q_logits: np.ndarray) -> tuple[float, float]:
    p, q = ref_logits.astype(np.float64), q_logits.astype(np.float64)
    logp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    return float((np.exp(logp) * (logp - logq)).sum(1).mean()), float(
        (p.argmax(1) == q.argmax(1)).mean()
    )


async def _teacher_forced(store, ids, tokens, activations):
    async with open_engine(store, activations=activations) as engine:
        seq = engine.new_sequence()
        out = [await engine.forward(seq, ids)]
        for tok in tokens[:-1]:
            out.append(await engine.forward(seq, [tok]))
    return np.stack(out)


# expert quant -> mean KL bound against the f32 store (dense f32, so only the experts differ),
# teacher-forced, on a Mixtral of hidden size 256 (K-quants need 256 columns). Measured
# (f32 / q8_0 activations): q4_0 7.3e-2, q4_k 3.2e-2, q5_k 7.2e-3 / 7.9e-3, q6_k 2.1e-3 /
# 2.3e-3, q5_1 3.4e-2, mxfp4 1.1e-1, fp8 5.5e-3 / 2.9e-2 (one routing flip); bounds ~3x. A
# mixed-up layout or type gives KL of order 1.
CONVERT_BOUNDS = {"q4_0": 0.2, "q4_k": 0.1, "q5_k": 0.025, "q6_k": 0.01, "q5_1": 0.1,
                  "mxfp4": 0.3, "fp8": 0.08}  # fmt: skip


async def test_convert_to_new_types_runs_close_to_float(tmp_path, monkeypatch):
    """`colibri convert --quant T` with the new types (quantizers from float) runs on both
    activation kinds within CONVERT_BOUNDS of the f32 store; the K-quants keep their order of
    quality (q6_k < q5_k < q4_k < q4_0)."""
    monkeypatch.setitem(
        hf_models.CASES,
        "mixtral_256",
        ("mixtral", dict(hidden_size=256, intermediate_size=256, num_local_experts=4,
                               num_experts_per_tok=2, rope_theta=1e4)),
    )  # fmt: skip
    model = hf_models.build("mixtral_256", seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    convert(src, tmp_path / "f32", quant="f32", dense_quant="f32")
    ids = np.random.default_rng(5).integers(0, model.config.vocab_size, 24).tolist()
    tokens, ref_logits = await hf_models.engine_greedy(tmp_path / "f32", ids, 12, activations="f32")
    for activations in ("f32", "q8_0"):
        kls = {}
        for quant, bound in CONVERT_BOUNDS.items():
            store = tmp_path / quant
            if not store.exists():
                convert(src, store, quant=quant, dense_quant="f32")
                assert open_store(store).layout.weight_qtypes == (quant,) * 3
            q_logits = await _teacher_forced(store, ids, tokens, activations)
            kls[quant], top1 = _kl_top1(ref_logits, q_logits)
            print(f"{quant} {activations}: KL {kls[quant]:.2e}, top-1 {top1:.3f}")
            assert kls[quant] <= bound, (quant, activations, kls[quant])
        assert kls["q6_k"] < kls["q5_k"] < kls["q4_k"] < kls["q4_0"], kls
