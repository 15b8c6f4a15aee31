"""Issue 12, integrity: overlapping safetensors offsets (source checkpoints and a store's
dense.safetensors), dense checksums, manifests whose config lies, and a fuzz test over
manifest and header edits: open_store either opens a store whose every shape matches its
bytes or raises StoreError."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.cli import main
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import ConversionError, StoreError
from colibri.io.format import QTYPES, dense_dtype_shape, open_store, tensor_nbytes
from tests import hf_models

safetensors = pytest.importorskip("safetensors")


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    """The process failed with exactly one line on stderr, naming every needle."""
    assert res.returncode != 0, res.stdout
    assert "Traceback" not in res.stderr, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def cli_error(capsys, *args: str) -> str:
    """`colibri ARGS` in this process (faster than a subprocess): it must exit 1 with one
    line on stderr (an exception it did not turn into that line fails the test)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 1 and len(lines) == 1, err
    return lines[0]


def colibri(*args: str, memory: int = 3 << 30, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m colibri ARGS` under an address-space limit (a runaway allocation fails
    instead of reaching the machine's memory) and a time limit."""
    code = (
        "import resource, sys, runpy; "
        f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory})); "
        "sys.argv = ['colibri', *sys.argv[1:]]; runpy.run_module('colibri', run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    model = hf_models.build("mixtral", seed=1)
    return hf_models.save(model, tmp_path_factory.mktemp("rel") / "hf")


@pytest.fixture(scope="module")
def base_store(hf_src):
    out = hf_src.parent / "store"
    convert(hf_src, out, quant="q8_0", dense_quant="q8_0", show_progress=False)
    return out


@pytest.fixture
def store(base_store, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(base_store, dst)
    return dst


def edit_manifest(store: Path, fn) -> None:
    m = json.loads((store / "manifest.json").read_text())
    fn(m)
    (store / "manifest.json").write_text(json.dumps(m))


# ---- item 5: overlapping data_offsets ------------------------------------------------------

A = "model.layers.0.input_layernorm.weight"
B = "model.layers.1.input_layernorm.weight"


def test_overlapping_offsets_in_a_source_checkpoint(hf_src, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    path = src / "model.safetensors"
    header, data = read_header(path)
    assert header[A]["shape"] == header[B]["shape"]
    header[B]["data_offsets"] = header[A]["data_offsets"]  # B reads A's bytes
    write_header(path, header, data)
    # the safetensors library refuses the file too
    with pytest.raises(safetensors.SafetensorError), safetensors.safe_open(str(path), "np") as f:
        f.get_tensor(B)
    with pytest.raises(ConversionError, match=r"model\.safetensors: tensors .* overlap"):
        convert(src, tmp_path / "out", show_progress=False)
    line = cli_error(capsys, "convert", src, tmp_path / "out")
    assert str(path) in line and "overlap" in line and A in line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_overlapping_offsets_in_a_store(store, capsys):
    path = store / "dense.safetensors"
    header, data = read_header(path)
    a, b = "model.layers.0.post_attention_layernorm.weight", A
    header[b]["data_offsets"] = [header[a]["data_offsets"][0] + 4, header[a]["data_offsets"][1] + 4]
    write_header(path, header, data)
    with pytest.raises(StoreError, match=r"dense\.safetensors: tensors .* overlap"):
        open_store(store)
    line = cli_error(capsys, "run", store, "-p", "x")
    assert str(path) in line and "overlap" in line


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h.clear() or h.update({"x": [1, 2]}), "header entry is not an object"),
        (lambda h: h[A].pop("data_offsets"), "data_offsets None"),
        (lambda h: h[A].update(data_offsets=[8, 4]), "begin <= end"),
        (lambda h: h[A].update(shape=[-1]), "not a list of non-negative integers"),
        (lambda h: h[A].update(dtype="F99"), "unknown dtype"),
        (lambda h: h[A].update(shape=[3]), "needs 12"),
    ],
)
def test_malformed_source_header(hf_src, tmp_path, capsys, edit, message):
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    header, data = read_header(src / "model.safetensors")
    edit(header)
    write_header(src / "model.safetensors", header, data)
    line = cli_error(capsys, "convert", src, tmp_path / "out")
    assert str(src / "model.safetensors") in line and message in line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_source_header_not_an_object(hf_src, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    raw = b"[1, 2, 3]"
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    assert "not an object" in cli_error(capsys, "convert", src, tmp_path / "out")


# ---- item 6: dense checksums -----------------------------------------------------------------


def test_dense_checksums_in_the_manifest(store):
    s = open_store(store)
    header, data = read_header(store / "dense.safetensors")
    import xxhash

    for name in s.dense_names():
        b, e = header[name]["data_offsets"]
        assert s.manifest["dense"][name]["xxh3"] == f"{xxhash.xxh3_64_intdigest(data[b:e]):016x}"
    assert s.dense_checksummed and s.verify_dense() == len(s.dense_names())


def test_flipped_dense_byte_is_caught_by_verify_and_by_loading(store, capsys):
    s = open_store(store)
    name = "model.layers.1.self_attn.k_proj.weight"
    b = s._dense_header[name]["data_offsets"][0] + s._dense_start
    raw = bytearray((store / "dense.safetensors").read_bytes())
    raw[b + 7] ^= 0x10
    (store / "dense.safetensors").write_bytes(raw)
    open_store(store)  # opening stays cheap: the header is fine
    line = cli_error(capsys, "inspect", store, "--verify")
    assert "dense.safetensors" in line and name in line and "xxh3" in line
    line = cli_error(capsys, "run", store, "-p", "hello", "-n", "2", "--io", "threads")
    assert "dense.safetensors" in line and name in line and "checksum mismatch" in line


async def test_store_without_dense_checksums_still_opens_and_runs(store, base_store, capsys):
    edit_manifest(store, lambda m: [d.pop("xxh3") for d in m["dense"].values()])
    s = open_store(store)
    assert not s.dense_checksummed and s.verify_dense() == 0
    assert main(["inspect", str(store), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "0 of" in out and "re-convert" in out
    outputs = []
    for path in (store, base_store):
        async with open_engine(path, io="threads") as engine:
            outputs.append([t.token_id async for t in engine.stream([1, 2, 3], max_tokens=4)])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5  # 4 tokens + the final item


# ---- item 10: manifests whose config lies ---------------------------------------------------


def _cfg(**kw):
    return lambda m: m["config"].update(kw)


LIES = {
    "top_k_0": (_cfg(num_experts_per_tok=0), r"config: field 'num_experts_per_tok' is 0"),
    "top_k_2.5": (_cfg(num_experts_per_tok=2.5), r"field 'num_experts_per_tok' is 2\.5"),
    "top_k_above_experts": (_cfg(num_experts_per_tok=7), r"'num_experts_per_tok' is 7"),
    "layers_-1": (_cfg(num_hidden_layers=-1), r"field 'num_hidden_layers' is -1"),
    "layers_fewer": (_cfg(num_hidden_layers=2), r"'num_hidden_layers' is 2, but experts exist"),
    "layers_more": (_cfg(num_hidden_layers=4), r"'num_hidden_layers' is 4, but the store's"),
    "layers_1e9": (_cfg(num_hidden_layers=10**9), r"'num_hidden_layers' is 1000000000"),
    "layers_null": (_cfg(num_hidden_layers=None), r"missing field 'num_hidden_layers'"),
    "heads_0": (_cfg(num_attention_heads=0), r"field 'num_attention_heads' is 0"),
    "head_dim_0": (_cfg(head_dim=0), r"field 'head_dim' is 0"),
    "window_x": (_cfg(sliding_window="x"), r"field 'sliding_window' is 'x'"),
    "ffn_list": (_cfg(intermediate_size=[96]), r"field 'intermediate_size' is \[96\]"),
    "experts_count": (_cfg(num_local_experts=5), r"routed-expert count is 5"),
    "hidden": (_cfg(hidden_size=32), r"field 'hidden_size' is 32"),
    "rope_theta_neg": (
        _cfg(rope_parameters={"rope_type": "default", "rope_theta": -5.0}),
        r"field 'rope_parameters'\.rope_theta is -5\.0: needs a positive number",
    ),
    "rope_factor_0": (
        _cfg(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 0}),
        r"field 'rope_parameters'\.factor is 0",
    ),
    "config_list": (lambda m: m.update(config=[1, 2]), r"config is a list, not a JSON object"),
    "tensors_list": (
        lambda m: m["expert_layout"].update(tensors=["gate"]),
        r"expert_layout\.tensors: not an object",
    ),
    "layout_qtype": (
        lambda m: m["expert_layout"].update(qtype="q4_0"),
        r"expert_layout\.tensors\.gate\.qtype 'q8_0' differs from the layout's 'q4_0'",
    ),
    "expert_-1": (lambda m: m["experts"][1].update(expert=-1), r"experts\[1\]: .*expert -1"),
    "dense_not_object": (lambda m: m.update(dense=[]), r"field 'dense' is not an object"),
    "experts_file": (lambda m: m.update(experts_file="../x"), r"field 'experts_file'"),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_manifest_lie_is_a_store_error_naming_the_field(store, case):
    edit, message = LIES[case]
    edit_manifest(store, edit)
    with pytest.raises(StoreError, match=message):
        open_store(store)
    assert main(["inspect", str(store)]) == 1


@pytest.mark.parametrize("case", ["top_k_0", "layers_1e9", "expert_-1", "window_x"])
def test_manifest_lie_run_exits_with_one_line(store, case):
    edit_manifest(store, LIES[case][0])
    res = colibri("run", str(store), "-p", "hello", "-n", "2", "--io", "threads", timeout=60)
    assert "manifest.json" in one_line_error(res)


# ---- fuzz: open_store opens consistent stores or raises StoreError -----------------------------

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.sampled_from([2**31, 10**12, 4096, 64, 96]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-2, 200), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _paths(obj, prefix=()):
    """Every (path) into a JSON value, capped per list to a few entries."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, (*prefix, i))


def _apply(obj, path, value, delete):
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return obj


def _check_consistent(s) -> None:
    """Everything open_store promises: dense shapes match their bytes, records lie in the
    experts file, the config's figures agree with them."""
    header, data_start = s._dense_header, s._dense_start
    size = s.dense_path.stat().st_size
    for name in s.dense_names():
        m, h = s.manifest["dense"][name], header[name]
        assert m["qtype"] in QTYPES
        dtype, stored = dense_dtype_shape(m["qtype"], m["shape"])
        assert (h["dtype"], list(h["shape"])) == (dtype, stored)
        b, e = h["data_offsets"]
        assert e - b == tensor_nbytes(m["qtype"], m["shape"]) and data_start + e <= size
        try:
            arr, _, shape = s.dense(name)
        except StoreError as exc:  # only a checksum mismatch may remain
            assert "checksum" in str(exc)
            continue
        assert arr.nbytes in (e - b, 2 * (e - b))  # f16/bf16 widened to f32
        assert tuple(shape) == tuple(m["shape"])
    experts = s.experts_path.stat().st_size
    for r in s.records:
        assert r.offset >= 0 and r.offset + r.nbytes <= experts
        assert r.nbytes == s.layout.record_nbytes
    cfg = s.config
    assert cfg["num_hidden_layers"] > max(s.moe_layers)
    assert 0 < cfg.get("num_experts_per_tok", 1) <= s.num_experts


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_manifest_and_header_edits(base_store, tmp_path_factory, data):
    store = tmp_path_factory.mktemp("fuzz") / "s"
    store.mkdir()
    for f in base_store.iterdir():  # the two edited files are copies, the rest links
        if f.name in ("manifest.json", "dense.safetensors"):
            shutil.copy(f, store / f.name)
        else:
            (store / f.name).symlink_to(f)
    manifest = json.loads((store / "manifest.json").read_text())
    header, blob = read_header(store / "dense.safetensors")
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        if data.draw(st.booleans(), label="edit the header"):
            paths = list(_paths(header))
            path = data.draw(st.sampled_from(paths), label="header path")
            header = _apply(header, path, data.draw(VALUES), data.draw(st.booleans()))
        else:
            paths = [p for p in _paths(manifest) if p[:1] != ("format",) and p[:1] != ("version",)]
            path = data.draw(st.sampled_from(paths), label="manifest path")
            manifest = _apply(manifest, path, data.draw(VALUES), data.draw(st.booleans()))
    (store / "manifest.json").write_text(json.dumps(manifest))
    write_header(store / "dense.safetensors", header, blob)
    try:
        s = open_store(store)
    except StoreError:
        return
    _check_consistent(s)
    shutil.rmtree(store.parent)
