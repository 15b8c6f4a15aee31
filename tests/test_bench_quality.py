"""colibri/bench/sec_quality.py's requantize(): a store re-encoded from its f32 store holds the very
expert bytes `colibri convert --quant X` writes from the checkpoint, and f32 dense weights."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.bench.sec_quality import requantize
from colibri.convert import convert
from colibri.io.format import open_store
from tests import hf_models


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "bf16"])
def test_requantize_equals_convert(tmp_path, qtype):
    src = hf_models.save(hf_models.build("mixtral", seed=1), tmp_path / "hf")
    f32 = convert(src, tmp_path / "f32", quant="f32", dense_quant="f32", show_progress=False)
    direct = convert(src, tmp_path / "direct", quant=qtype, dense_quant="f32", show_progress=False)
    again = requantize(f32, tmp_path / "again", qtype)
    a, b = open_store(direct), open_store(again)
    assert a.layout == b.layout
    assert a.experts_path.read_bytes() == b.experts_path.read_bytes()
    for name in a.dense_names():
        x, qx, _ = a.dense(name)
        y, qy, _ = b.dense(name)
        assert qx == qy == "f32" and np.array_equal(x, y), name
