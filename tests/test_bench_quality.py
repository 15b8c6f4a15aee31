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
