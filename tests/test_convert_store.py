"""A store as `colibri convert`'s SRC (colibri/convert/store.py): the demo's f32 reference for
`colibri eval --reference`, made by the command README shows, holds exactly the demo's q8_0
weights as the gguf package dequantizes them."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from colibri.errors import ConversionError  # noqa: E402
from colibri.io.format import open_store  # noqa: E402
from colibri.run import DEMO_STORE  # noqa: E402


def colibri(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args], capture_output=True, text=True, timeout=300
    )


def _q8_0(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    q8 = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(np.asarray(raw, np.uint8).reshape(shape[0], -1), q8)


@pytest.fixture(scope="module")
def demo_f32(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "demo-f32"
    res = colibri("convert", str(DEMO_STORE), str(out), "--quant", "f32", "--dense-quant", "f32")
    assert res.returncode == 0, res.stderr
    return out


def test_f32_store_of_the_demo_holds_its_dequantized_weights(demo_f32):
    demo, ref = open_store(DEMO_STORE), open_store(demo_f32)
    assert ref.config == demo.config and set(ref.dense_names()) == set(demo.dense_names())
    for name in demo.dense_names():
        arr, qtype, shape = demo.dense(name)
        got, got_qtype, _ = ref.dense(name)
        assert got_qtype == "f32", name
        want = _q8_0(arr, shape) if qtype == "q8_0" else np.asarray(arr, np.float32)
        np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want, err_msg=name)
    blob, ref_blob = demo.experts_path.read_bytes(), ref.experts_path.read_bytes()
    assert len(ref.records) == len(demo.records)
    for rec in demo.records:
        r = ref.record(rec.layer, rec.expert)
        for role in ("gate", "up", "down"):
            spec = demo.layout_for(rec.layer).tensors[role]
            rspec = ref.layout_for(rec.layer).tensors[role]
            assert spec.qtype == "q8_0" and rspec.qtype == "f32"
            raw = np.frombuffer(blob, np.uint8, spec.nbytes, rec.offset + spec.offset)
            got = np.frombuffer(ref_blob, np.float32, int(np.prod(rspec.shape)),
                                r.offset + rspec.offset).reshape(rspec.shape)  # fmt: skip
            np.testing.assert_array_equal(got, _q8_0(raw, spec.shape), err_msg=f"{rec} {role}")
    for f in [*demo.manifest["tokenizer_files"], "generation_config.json"]:
        assert (demo_f32 / f).read_bytes() == (DEMO_STORE / f).read_bytes(), f
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(demo_f32.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700


def test_eval_reference_with_the_f32_demo(demo_f32, tmp_path):
    """The README's eval example on the demo: the f32 store as --reference gives a KL line and
    a reference perplexity (the same weights: the two PPLs agree to 1%)."""
    text = tmp_path / "text.txt"
    text.write_text(__import__("pydoc_data.topics").topics.topics["for"] * 4)
    res = colibri("eval", "--task", "perplexity", "--data", str(text), "--ctx", "128",
                  "--limit", "2", "--reference", str(demo_f32))  # fmt: skip
    assert res.returncode == 0, res.stderr
    ppl = float(re.search(r"PPL = ([\d.]+)", res.stdout + res.stderr).group(1))
    ref = float(re.search(r"reference PPL = ([\d.]+)", res.stdout + res.stderr).group(1))
    assert "KL(reference || this)" in res.stdout + res.stderr
    assert abs(ppl - ref) / ref < 0.01


def test_a_store_of_another_family_is_refused(tmp_path):
    src = tmp_path / "qwen"
    shutil.copytree(DEMO_STORE, src)
    m = json.loads((src / "manifest.json").read_text())
    m["model_type"] = "qwen3_moe"
    (src / "manifest.json").write_text(json.dumps(m))
    from colibri.convert import convert

    with pytest.raises(ConversionError, match=r"Mixtral stores .* model_type 'qwen3_moe'"):
        convert(src, tmp_path / "out", quant="f32", dense_quant="f32")
    assert not (tmp_path / "out").exists()


def test_an_error_names_the_store_not_its_temporary_copy(tmp_path):
    """The demo's expert rows (192, 320 weights) cannot be q4_k: the message names the store."""
    res = colibri("convert", str(DEMO_STORE), str(tmp_path / "out"), "--quant", "q4_k")
    assert res.returncode == 1
    assert str(DEMO_STORE) in res.stderr and "colibri-store-src" not in res.stderr, res.stderr
    assert "q4_k needs a multiple of 256 columns" in res.stderr
