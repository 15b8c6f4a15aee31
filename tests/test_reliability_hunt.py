"""Issue 12, the second bug hunt's findings (same kinds, new inputs): malformed routing traces
and replay options, export-gguf onto a bad OUT, malformed shard indexes, JSON nested past the
recursion limit, config values the family refuses, token-id prompts that are not integers.
Each is a one-line error naming the file or field, with nothing left behind."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibri.cli import main
from colibri.engine import open_engine
from colibri.errors import ColibriError
from colibri.run import DEMO_STORE
from tests import hf_models
from tests.test_reliability_cli import base_store, hf_src, leftovers  # noqa: F401 - fixtures
from tests.test_reliability_store import cli_error, colibri

META = {"format": "colibri-routing-trace", "version": 1, "num_experts": 8}


def trace_file(path, experts, meta=META):
    np.savez(
        path,
        experts=experts,
        weights=np.zeros(experts.shape, np.float32),
        meta=np.array(json.dumps(meta)),
    )
    return path


TRACES = {
    "float_ids": (np.zeros((2, 3, 2), np.float32), META, "dtype float32, expected integers"),
    "negative_id": (np.array([[[5, -3]] * 3] * 2, np.int32), META, "expert id -3 out of range"),
    "id_too_big": (np.full((2, 3, 2), 9, np.int32), META, "expert id 9 out of range"),
    "meta_list": (np.zeros((2, 3, 2), np.int32), [1], "meta is a list"),
    "no_experts": (np.zeros((2, 3, 2), np.int32), META | {"num_experts": 0}, "at least 1"),
    "experts_str": (np.zeros((2, 3, 2), np.int32), META | {"num_experts": "8"}, "not an integer"),
}


@pytest.mark.parametrize("case", sorted(TRACES))
def test_malformed_trace(tmp_path, capsys, case):
    experts, meta, message = TRACES[case]
    path = trace_file(tmp_path / "t.npz", experts, meta)
    for extra in (["--offline"], ["--io", "threads", "--synthetic-dir", str(tmp_path)]):
        line = cli_error(capsys, "replay", path, *extra)
        assert str(path) in line and message in line
    assert leftovers(tmp_path, "colibri-replay") == []


@pytest.mark.parametrize("flag", ["--record-nbytes", "--max-tokens", "--budget-records"])
def test_replay_option_below_one(tmp_path, capsys, flag):
    path = trace_file(tmp_path / "t.npz", np.zeros((2, 3, 2), np.int32))
    value = "0" if flag != "--max-tokens" else "-1"
    line = cli_error(capsys, "replay", path, flag, value, "--synthetic-dir", tmp_path)
    assert f"{flag} {value}: must be at least 1" in line


def test_export_gguf_onto_a_bad_out(tmp_path, capsys):
    pytest.importorskip("gguf")
    missing = tmp_path / "no" / "such" / "dir" / "x.gguf"
    assert f"{missing}: directory" in cli_error(capsys, "export-gguf", DEMO_STORE, missing)
    (tmp_path / "adir").mkdir()
    line = cli_error(capsys, "export-gguf", DEMO_STORE, tmp_path / "adir", "--force")
    assert f"{tmp_path / 'adir'}: is a directory" in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir"]  # nothing else written


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"weight_map": [1]}, "weight_map is not an object"),
        ({"weight_map": {"model.norm.weight": 5}}, "weight_map['model.norm.weight'] is 5"),
        ({"weight_map": {"model.norm.weight": "../x"}}, "not a file name"),
        ([], "malformed"),
    ],
)
def test_malformed_shard_index(hf_src, tmp_path, capsys, index, message):  # noqa: F811
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    line = cli_error(capsys, "convert", src, tmp_path / "out")
    assert str(src / "model.safetensors.index.json") in line and message in line
    assert not leftovers(tmp_path, "out")


def test_json_nested_past_the_recursion_limit(hf_src, base_store, tmp_path, capsys):  # noqa: F811
    deep = "[" * 100000 + "]" * 100000
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    (src / "config.json").write_text(deep)
    assert "config.json: not valid" in cli_error(capsys, "convert", src, tmp_path / "out")
    store = tmp_path / "store"
    shutil.copytree(base_store, store)
    (store / "manifest.json").write_text(deep)
    assert "manifest.json: not valid JSON" in cli_error(capsys, "inspect", store)


def test_config_value_the_family_refuses_fails_at_convert(hf_src, tmp_path, capsys):  # noqa: F811
    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "bogus", "factor": 2.0}
    (src / "config.json").write_text(json.dumps(cfg))
    line = cli_error(capsys, "convert", src, tmp_path / "out")
    assert str(src / "config.json") in line and "rope_type" in line and "bogus" in line
    assert not leftovers(tmp_path, "out")


@pytest.mark.parametrize("prompt", [[[1]], ["a"], [1.5], [True], [2, None]])
async def test_token_id_prompt_must_hold_integers(base_store, prompt):  # noqa: F811
    async with open_engine(base_store, io="threads") as engine:
        with pytest.raises(ColibriError, match="a list must hold token ids"):
            await engine.generate(prompt, max_tokens=2)
        assert len([t async for t in engine.stream([np.int64(3), 4], max_tokens=2)]) == 3


async def test_generation_config_not_an_object(base_store, tmp_path):  # noqa: F811
    store = tmp_path / "store"
    shutil.copytree(base_store, store)
    (store / "generation_config.json").write_text("[1]")
    with pytest.raises(ColibriError, match=r"generation_config\.json: expected a JSON object"):
        async with open_engine(store, io="threads"):
            pass


async def test_no_generation_config_is_greedy(base_store, tmp_path):  # noqa: F811
    """Without generation_config.json sampling is greedy (README, transformers' do_sample
    default): repeated unseeded runs give the tokens of temperature 0; a file that is not
    JSON is refused naming it."""
    store = tmp_path / "store"
    shutil.copytree(base_store, store)
    (store / "generation_config.json").unlink(missing_ok=True)
    async with open_engine(store, io="threads") as engine:
        assert engine.generation_defaults == {"temperature": 0.0}
        greedy = [t.token_id async for t in engine.stream([3, 4], max_tokens=8, temperature=0)]
        for _ in range(3):
            assert [t.token_id async for t in engine.stream([3, 4], max_tokens=8)] == greedy
    (store / "generation_config.json").write_text("{")
    with pytest.raises(ColibriError, match=r"generation_config\.json: not readable JSON"):
        async with open_engine(store, io="threads"):
            pass


@pytest.mark.parametrize(
    "cfg, field", [({"temperature": "hot"}, "temperature"), ({"top_p": 2}, "top_p")]
)
async def test_generation_config_bad_value_names_the_file(base_store, tmp_path, cfg, field):  # noqa: F811
    """A sampling default out of range names generation_config.json, not only the field."""
    store = tmp_path / "store"
    shutil.copytree(base_store, store)
    (store / "generation_config.json").write_text(json.dumps({"do_sample": True, **cfg}))
    with pytest.raises(ColibriError, match=rf"generation_config\.json: {field}="):
        async with open_engine(store, io="threads"):
            pass


def test_budget_above_every_record_reserves_only_what_they_need():
    """--budget 100T used to fail with a bare '[Errno 12] Cannot allocate memory'."""
    res = colibri(
        "run", "--budget", "100T", "-n", "3", "--temperature", "0", "--io", "threads",
        memory=3 << 30,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "3 generated tokens" in res.stderr


def test_invalid_size(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--budget", "1.5.5G"])
    assert "invalid size '1.5.5G'" in capsys.readouterr().err


@pytest.mark.parametrize("head_count", [0, 4])
def test_gguf_with_malformed_metadata(tmp_path, capsys, head_count):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.expert_count", 8)
    w.add_uint32("llama.embedding_length", 64)
    w.add_uint32("llama.attention.head_count", head_count)  # and no tensors at all
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    line = cli_error(capsys, "convert", path, tmp_path / "out")
    assert f"{path}: malformed GGUF metadata" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_expert_width_not_a_block_multiple(tmp_path, capsys, monkeypatch):
    model_type, extra = hf_models.CASES["mixtral"]
    monkeypatch.setitem(hf_models.CASES, "mixtral", (model_type, extra | {"intermediate_size": 40}))
    src = hf_models.save(hf_models.build("mixtral"), tmp_path / "hf")
    line = cli_error(capsys, "convert", src, tmp_path / "out", "--quant", "q4_0")
    assert f"{src}: --quant q4_0 cannot hold the experts' rows of 64 (gate, up) and 40" in line
    assert "q4_0 needs a multiple of 32 columns, got 40" in line
    assert not leftovers(tmp_path, "out")
    assert main(["convert", str(src), str(tmp_path / "out"), "--quant", "f16"]) == 0


async def test_norm_stored_as_blocks_is_refused(base_store, tmp_path):  # noqa: F811
    """A manifest may describe a norm as q8_0 consistently (header, sizes): its block bytes
    used to be read as floats."""
    from tests.test_reliability_store import read_header, write_header

    store = tmp_path / "store"
    shutil.copytree(base_store, store)
    name = "model.norm.weight"
    header, data = read_header(store / "dense.safetensors")
    b, _ = header[name]["data_offsets"]
    n = header[name]["shape"][0]
    header[name] = {"dtype": "U8", "shape": [n // 32 * 34], "data_offsets": [b, b + n // 32 * 34]}
    write_header(store / "dense.safetensors", header, data)
    m = json.loads((store / "manifest.json").read_text())
    m["dense"][name] = {"qtype": "q8_0", "shape": [n]}
    (store / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ColibriError, match=f"tensor '{name}' is q8_0; norms, biases"):
        async with open_engine(store, io="threads"):
            pass


def test_serve_port_out_of_range_or_taken(capsys):
    """--port outside 0..65535 is refused by argparse (it was taken modulo 65536, or traced
    back); a port already in use is one line naming host:port, before the engine loads."""
    import socket

    for bad in ("99999", "-1"):
        with pytest.raises(SystemExit):
            main(["serve", "--port", bad])
        assert f"invalid port '{bad}' (0..65535)" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = cli_error(capsys, "serve", "--port", str(port))
    assert f"127.0.0.1:{port}: cannot listen there" in line
