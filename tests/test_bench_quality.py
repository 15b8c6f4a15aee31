"""colibri/bench/sec_quality.py's requantize(): a store re-encoded from its f32 store holds the very
expert bytes `colibri convert --quant X` writes from the checkpoint, and f32 dense weights (or,
with dense="q8_0", the dense bytes of `colibri convert --dense-quant q8_0`: q8_0 embeddings,
attention and output head, f32 norms and routers)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.bench.sec_quality import requantize
from colibri.convert import convert
from colibri.io.format import open_store
from tests import hf_models


@pytest.mark.parametrize(
    "qtype,dense", [("q4_0", "f32"), ("q4_1", "f32"), ("bf16", "f32"), ("q4_0", "q8_0")]
)
def test_requantize_equals_convert(tmp_path, qtype, dense):
    src = hf_models.save(hf_models.build("mixtral", seed=1), tmp_path / "hf")
    f32 = convert(src, tmp_path / "f32", quant="f32", dense_quant="f32", show_progress=False)
    direct = convert(src, tmp_path / "direct", quant=qtype, dense_quant=dense, show_progress=False)
    again = requantize(f32, tmp_path / "again", qtype, dense=dense)
    a, b = open_store(direct), open_store(again)
    assert a.layout == b.layout
    assert a.experts_path.read_bytes() == b.experts_path.read_bytes()
    types = set()
    for name in a.dense_names():
        x, qx, _ = a.dense(name)
        y, qy, _ = b.dense(name)
        assert qx == qy and np.array_equal(x, y), name
        types.add(qx)
    assert a.dense("lm_head.weight")[1] == dense
    assert types == {"f32"} | {dense}


def test_speed_rows_real_layer_store(tmp_path, monkeypatch):
    """_speed_rows measures a real-layer-shape store in core and with a third of its
    experts' bytes cached, and its row's ratios are the measured figures' quotients."""
    from types import SimpleNamespace

    from colibri.bench import sec_quality

    src = hf_models.save(hf_models.build("mixtral", seed=1), tmp_path / "hf")
    store = convert(src, tmp_path / "q4", quant="q4_0", dense_quant="q8_0", show_progress=False)
    calls = []
    rng = np.random.default_rng(0)

    async def fake(path, text, docs, *, threads, budget=None, rounds=3):
        calls.append((path, budget, len(docs)))
        r = {k: float(v) for k, v in zip(FIELDS, rng.uniform(1, 100, len(FIELDS)), strict=True)}
        return {**r, "hellaswag_acc": 0.25}

    monkeypatch.setattr(sec_quality, "eval_speed", fake)
    ctx = SimpleNamespace(quick=True, threads=1, log=lambda m: None)
    rows, data, n = sec_quality._speed_rows(ctx, {}, tmp_path, "text", store)
    third = sum(r.nbytes for r in open_store(store).records) // 3
    assert third > 0
    assert calls == [(store, None, n), (store, third, n)]
    assert len(rows) == 2 and rows[0][2] == "in core" and rows[1][2] == "1/3 of experts cached"
    r = data["real/dense q8_0/in core"]
    assert rows[0][5] == f"{r['ppl_fused'] / r['prefill']:.2f}"
    assert rows[0][11] == f"{r['ppl_fused_cpu'] / r['prefill_cpu']:.2f}"
    assert "layers" in rows[0][0]


FIELDS = [
    f"{a}{b}"
    for a in ("prefill", "ppl_fused", "hellaswag_fused", "hellaswag_split")
    for b in ("", "_cpu", "_head", "_lse", "_rest_cpu")
] + [
    "bytes_per_token_prefill",
    "bytes_per_token_ppl_fused",
    "bytes_per_token_hellaswag_fused",
]
