"""Bad checkpoints: each gets a ConversionError/StoreError naming the file and tensor, the CLI
exits non-zero, and neither OUT nor OUT.tmp-* is left behind."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from colibri import registry  # noqa: E402
from colibri.cli import main  # noqa: E402
from colibri.convert import convert  # noqa: E402
from colibri.errors import ConversionError, StoreError  # noqa: E402
from colibri.io.format import open_store  # noqa: E402
from tests.test_convert_hf import make_model, save  # noqa: E402

EXP = "model.layers.1.block_sparse_moe.experts.2.w1.weight"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    model = make_model("mixtral", seed=3)
    d = tmp_path_factory.mktemp("bad")
    return save(model, d / "orig", original=True), save(model, d / "sharded", original=True,
                                                        shard=True)  # fmt: skip


def copy_ckpt(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_tensors(ckpt, fn):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(ckpt, **kw):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(kw)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def expect_failure(src, tmp_path, pattern, exc=ConversionError):
    out = tmp_path / "out"
    with pytest.raises(exc, match=pattern):
        convert(src, out, show_progress=False)
    assert main(["convert", str(src), str(out)]) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_missing_expert_tensor(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    edit_tensors(src, lambda t: t.pop(EXP))
    expect_failure(src, tmp_path, r"src: missing tensor for layer 1 expert 2 gate")


def test_extra_expert_tensor(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    edit_tensors(src, lambda t: t.update({EXP.replace(".2.", ".7."): t[EXP].clone()}))
    expect_failure(src, tmp_path, r"extra tensor 'model\.layers\.1\.block_sparse_moe\.experts\.7")


def test_extra_unrelated_tensor(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    edit_tensors(src, lambda t: t.update({"vision_tower.proj.weight": torch.zeros(4, 4)}))
    expect_failure(src, tmp_path, r"model\.safetensors: unexpected tensor 'vision_tower")


def test_wrong_shape(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    edit_tensors(src, lambda t: t.update({EXP: t[EXP][:64].clone()}))
    expect_failure(src, tmp_path, rf"model\.safetensors: tensor '{EXP}' has shape \[64, 64\]")


def test_config_not_matching_weights(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    edit_config(src, intermediate_size=128)
    expect_failure(src, tmp_path, r"config\.json implies \[128, 64\]")
    edit_config(src, intermediate_size=96, num_hidden_layers=3)
    expect_failure(src, tmp_path, r"config\.json: field 'num_hidden_layers' is 3, but the "
                   r"checkpoint's tensors cover 2 layers")  # fmt: skip
    edit_config(src, num_hidden_layers=2, vocab_size=100)
    expect_failure(src, tmp_path, r"model\.embed_tokens\.weight' has shape \[128, 64\]")


def test_unknown_dtype(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    edit_tensors(src, lambda t: t.update({"model.layers.0.foo": torch.zeros(3, dtype=torch.int64)}))
    expect_failure(src, tmp_path, r"tensor 'model\.layers\.0\.foo' has dtype I64")


def test_truncated_safetensors(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    expect_failure(src, tmp_path, r"model\.safetensors: truncated: tensor '.*' ends at byte")


def test_missing_shard(mixtral, tmp_path):
    src = copy_ckpt(mixtral[1], tmp_path / "src")
    shards = sorted(src.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    expect_failure(src, tmp_path, rf"shard {shards[1].name} is missing")


def test_unsupported_architecture(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "src")
    edit_config(src, model_type="llama")
    archs = ", ".join(registry.SUPPORTED)
    expect_failure(src, tmp_path, f"unsupported architecture 'llama'; supported: {archs}")


def test_existing_out_needs_force(mixtral, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(StoreError, match=r"out: already exists \(use --force"):
        convert(mixtral[0], out, show_progress=False)
    assert (out / "keep").exists()
    assert main(["convert", str(mixtral[0]), str(out)]) == 1
    # --force never deletes what is not a store (or an empty directory)
    with pytest.raises(StoreError, match="not a colibri store"):
        convert(mixtral[0], out, force=True, show_progress=False)
    assert (out / "keep").exists()
    (out / "keep").unlink()
    assert main(["convert", str(mixtral[0]), str(out), "--force"]) == 0
    assert main(["convert", str(mixtral[0]), str(out), "--force", "--quant", "q8_0"]) == 0
    assert open_store(out).layout.qtype == "q8_0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_out_must_not_be_or_contain_src(mixtral, tmp_path):
    src = copy_ckpt(mixtral[0], tmp_path / "ckpt")
    for out in (src, tmp_path):
        with pytest.raises(ConversionError, match="must not be SRC or a directory containing"):
            convert(src, out, force=True, show_progress=False)
    assert (src / "config.json").exists()
