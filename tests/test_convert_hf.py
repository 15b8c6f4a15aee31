"""Tiny random transformers MoE models of every supported architecture (shared by the convert
and store tests): each family's base test case with hidden 64, expert d_ff 96 (so 2*d_ff !=
hidden and shapes cannot be confused), 2 layers, bf16."""

from __future__ import annotations

from pathlib import Path

from colibri import registry


def tiny_config(arch: str):
    """Family `arch`'s base test case (Family.test_configs), 2 layers, vocab 128 and expert
    d_ff 96 (so 2*d_ff != hidden and shapes cannot be confused)."""
    from tests import hf_models

    d_ff = registry.family(arch).d_ff_key
    return hf_models.config(arch, vocab_size=128, num_hidden_layers=2, **{d_ff: 96})


def make_model(arch: str, seed: int = 0):
    """A tiny random bf16 model of `arch` with non-trivial values in every parameter."""
    import torch

    from tests import hf_models

    torch.set_num_threads(1)
    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    model = hf_models.auto_class(arch).from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # norms/biases init to constants: make them random too
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.5)
    return model


def save(model, path: Path, *, original: bool, shard: bool = False) -> Path:
    kw = {"max_shard_size": "40KB"} if shard else {}
    model.save_pretrained(path, save_original_format=original, **kw)
    from tests import hf_models

    hf_models.family_layout(model, path)  # e.g. Kimi K2's config, Kimi K2.5's prefixes
    return path


# ---- tests ---------------------------------------------------------------------------------


import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gq_dequantize  # noqa: E402
from gguf.quants import quantize as gq_quantize  # noqa: E402

from colibri.convert import convert, dense_qtype  # noqa: E402
from colibri.io.format import open_store  # noqa: E402
from tests import hf_models  # noqa: E402

ROLES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up"}
ROLES["down_proj"] = "down"


def ref_quant(x: np.ndarray, qtype: str) -> np.ndarray:
    """The reference bytes of float32 `x` in `qtype` (gguf's quantizers), as uint8 rows."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    q = gq_quantize(x, gguf.GGMLQuantizationType[qtype.upper()])
    return np.ascontiguousarray(q).view(np.uint8).reshape(x.shape[0] if x.ndim > 1 else 1, -1)


def source_tensors(path, arch: str | None = None) -> dict[str, np.ndarray]:
    """Every tensor of an original-format checkpoint as float32 (via torch: bf16 exact); a
    multimodal family's language-model tensors under their text names (Family.text_prefixes),
    the others left out."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    if arch and (prefixes := registry.family(arch).text_prefixes):
        text = {}
        for k, v in out.items():
            for s, d in prefixes:
                if k.startswith(s):
                    text[d + k[len(s) :]] = v
                    break
        out = text
    return out


def text_part(arch: str, tensors: dict) -> dict:
    """A multimodal family's language-model tensors under their stored names (the converter's
    Family.text_prefixes renaming; the vision tower dropped); other families' unchanged."""
    prefixes = registry.family(arch).text_prefixes
    if not prefixes:
        return tensors
    return {
        dst + name[len(src) :]: x
        for name, x in tensors.items()
        for src, dst in prefixes
        if name.startswith(src)
    }


def reference_experts(model, arch: str, orig: dict[str, np.ndarray]):
    """{(layer, expert): {role: float32}} from the original-format files (hub per-expert names)
    or, for gpt-oss (fused in both formats), from transformers' GptOssExperts semantics:
    gate_up = x @ gate_up_proj[e] + bias, gate = [..., ::2], up = [..., 1::2]."""
    import re

    ref: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    pat = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight$")
    for name, x in orig.items():
        if m := pat.match(name):
            ref.setdefault((int(m[1]), int(m[2])), {})[ROLES[m[3]]] = x
    if arch == "gpt_oss":
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for e in range(ex.num_experts):
                gu = ex.gate_up_proj[e].float().detach().numpy()  # [H, 2I]
                gb = ex.gate_up_proj_bias[e].float().detach().numpy()
                ref[(i, e)] = {
                    "gate": gu[:, ::2].T,
                    "up": gu[:, 1::2].T,
                    "down": ex.down_proj[e].float().detach().numpy().T,
                    "gate_bias": gb[::2],
                    "up_bias": gb[1::2],
                    "down_bias": ex.down_proj_bias[e].float().detach().numpy(),
                }
    if arch == "llama4_text":  # Llama4TextExperts: gate_up = x @ gate_up_proj[e] [H, 2I]
        for i, layer in enumerate(model.model.layers):
            if not layer.is_moe_layer:
                continue
            ex = layer.feed_forward.experts
            for e in range(ex.num_experts):
                gu = ex.gate_up_proj[e].float().detach().numpy()
                I = gu.shape[1] // 2  # noqa: E741
                down = ex.down_proj[e].float().detach().numpy().T  # [I, H] -> [H, I]
                ref[(i, e)] = {"gate": gu[:, :I].T, "up": gu[:, I:].T, "down": down}
    if arch in ("gemma4_text", "gemma4"):  # Gemma4TextExperts: gate_up_proj [E, 2I, H] fused
        lm = getattr(model.model, "language_model", model.model)
        for i, layer in enumerate(lm.layers):
            ex = layer.experts
            for e in range(ex.num_experts):
                gu = ex.gate_up_proj[e].float().detach().numpy()
                I = gu.shape[0] // 2  # noqa: E741
                down = ex.down_proj[e].float().detach().numpy()
                ref[(i, e)] = {"gate": gu[:I], "up": gu[I:], "down": down}
    return ref


@pytest.fixture(scope="module", params=hf_models.BASE_CASES)
def tiny(request, tmp_path_factory):
    """(arch, model, {layout: checkpoint dir}) with original, fused and sharded-fused saves."""
    arch = request.param
    model = make_model(arch)
    model.colibri_family = arch
    d = tmp_path_factory.mktemp(arch)
    dirs = {
        "original": save(model, d / "orig", original=True),
        "fused": save(model, d / "fused", original=False),
        "sharded": save(model, d / "sharded", original=False, shard=True),
    }
    return arch, model, dirs


def test_convert_all_layouts_match_reference(tiny, tmp_path):
    """Every record's gate/up/down bytes equal gguf's quantization of the source expert, in all
    three layouts; every dense tensor equals its source (f32: exactly; q8_0: gguf's bytes)."""
    arch, model, dirs = tiny
    assert (dirs["sharded"] / "model.safetensors.index.json").is_file()
    orig = source_tensors(dirs["original"], arch)
    ref = reference_experts(model, arch, orig)
    stores = []
    for layout, src in dirs.items():
        out = convert(src, tmp_path / layout, quant="q4_1", show_progress=False)
        store = open_store(out)
        stores.append(store)
        assert store.model_type == arch
        assert sorted({k[0] for k in ref}) == store.moe_layers, layout
        assert len(store.records) == len(ref)
        with open(store.experts_path, "rb") as f:
            blob = f.read()
        for rec in store.records:
            raw = blob[rec.offset : rec.offset + rec.nbytes]
            store.verify_record(rec, raw)
            want = ref[(rec.layer, rec.expert)]
            assert set(want) == set(store.layout.tensors), (layout, rec)
            for name, spec in store.layout.tensors.items():
                got = raw[spec.offset : spec.offset + spec.nbytes]
                if spec.qtype == "f32":
                    exp = np.ascontiguousarray(want[name], dtype=np.float32).tobytes()
                else:
                    exp = ref_quant(want[name], spec.qtype).tobytes()
                assert got == exp, (arch, layout, rec.layer, rec.expert, name)
        # dense: same names as the original format (minus experts), values from the source
        dense = set(store.dense_names())
        assert dense == {n for n in orig if ".experts." not in n}, layout
        for name in dense:
            arr, qtype, shape = store.dense(name)
            src_x = orig[name]
            assert tuple(shape) == src_x.shape
            assert qtype == dense_qtype(name, shape, "q8_0")
            if qtype == "f32":
                np.testing.assert_array_equal(arr, src_x, err_msg=name)
            else:
                np.testing.assert_array_equal(arr, ref_quant(src_x, qtype), err_msg=name)
                deq = gq_dequantize(arr, gguf.GGMLQuantizationType[qtype.upper()])
                np.testing.assert_allclose(deq, src_x, atol=np.abs(src_x).max() / 50)
    # the three layouts give byte-identical stores
    a, b, c = (s.experts_path.read_bytes() for s in stores)
    assert a == b == c
    assert stores[0].dense_path.read_bytes() == stores[1].dense_path.read_bytes()


def test_routers_norms_biases_stay_f32(tiny, tmp_path):
    arch, _, dirs = tiny
    store = open_store(convert(dirs["fused"], tmp_path / "s", show_progress=False))
    for name in store.dense_names():
        q = store.dense_qtype(name)
        router = name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "router.weight"))
        if (
            router
            or "norm" in name
            or name.endswith(("bias", "sinks", "shared_expert_gate.weight"))
        ):
            assert q == "f32", name
        cols = store.manifest["dense"][name]["shape"][-1]
        if name.endswith(("q_proj.weight", "o_proj.weight", "embed_tokens.weight")):
            assert q == ("q8_0" if cols % 32 == 0 else "f32"), name  # whole q8_0 blocks only
    if arch == "mixtral":  # fused Mixtral's router is stored under its hub name
        assert "model.layers.0.block_sparse_moe.gate.weight" in store.dense_names()


def test_inspect_counts_match_transformers(tiny, tmp_path, capsys):
    """inspect's parameter count equals transformers' count; active parameters are
    dense + top-k experts per MoE layer; the CLI prints them and verifies checksums."""
    from colibri.cli import main
    from colibri.inspect import describe

    arch, model, dirs = tiny
    store = open_store(convert(dirs["original"], tmp_path / "s", show_progress=False))
    d = describe(store)
    # num_parameters() plus persistent buffers (DeepSeek-V3/GLM's e_score_correction_bias)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n in model.state_dict())
    total = model.num_parameters() + buffers
    from tests import hf_models

    if "vision_config" in hf_models.CASES[arch][1]:  # built multimodal: its language model
        total = sum(int(np.prod(x.shape)) for x in text_part(arch, model.state_dict()).values())
    assert d["params_total"] == total
    per_expert = sum(int(np.prod(t.shape)) for t in store.layout.tensors.values())
    dense = d["params_total"] - len(store.records) * per_expert
    text = model.config.get_text_config()
    k = getattr(text, "num_experts_per_tok", None) or text.top_k_experts  # Gemma 4's name
    assert d["params_active"] == dense + len(store.moe_layers) * k * per_expert
    num_experts = getattr(text, registry.family(arch).num_experts_key)
    assert (d["experts"], d["top_k"], d["architecture"]) == (num_experts, k, arch)
    assert main(["inspect", str(store.path), "--verify"]) == 0
    assert f"all {len(store.records)} records verified" in capsys.readouterr().out


@pytest.mark.parametrize("quant", ["f32", "f16", "bf16", "q4_0", "q8_0"])
def test_expert_quant_types_mixtral(quant, tmp_path):
    """Each --quant gives the reference encoding; f32 is exact, and dequantized q-types are
    within their block error of the source."""
    model = make_model("mixtral", seed=1)
    src = save(model, tmp_path / "src", original=False)
    store = open_store(
        convert(src, tmp_path / "out", quant=quant, dense_quant="f16", show_progress=False)
    )
    orig = source_tensors(save(model, tmp_path / "orig", original=True))
    ref = reference_experts(model, "mixtral", orig)
    rec = store.record(1, 3)
    raw = store.experts_path.read_bytes()[rec.offset : rec.offset + rec.nbytes]
    for name in ("gate", "up", "down"):
        spec = store.layout.tensors[name]
        got = np.frombuffer(raw[spec.offset : spec.offset + spec.nbytes], np.uint8)
        want = ref[(1, 3)][name]
        exp = ref_quant(want, quant).reshape(-1)
        np.testing.assert_array_equal(got, exp)
        deq = gq_dequantize(
            got.reshape(spec.shape[0], -1), gguf.GGMLQuantizationType[quant.upper()]
        )
        np.testing.assert_allclose(deq, want, atol=0 if quant in ("f32", "bf16") else 0.2)
    arr, q, _ = store.dense("model.layers.0.self_attn.q_proj.weight")
    assert q == "f16" and arr.dtype == np.float32
    np.testing.assert_array_equal(arr, orig["model.layers.0.self_attn.q_proj.weight"])


def test_tokenizer_files_carried_and_spm_converted(tmp_path):
    """tokenizer files are copied; a tokenizer.model-only checkpoint gets a tokenizer.json that
    tokenizes like SentencePiece itself (texts without runs of spaces: transformers' Llama
    conversion splits those differently from sentencepiece)."""
    spm_path = SHARED / "tokenizers/mixtral_mistral/tokenizer.model.v1"
    if not spm_path.is_file():
        pytest.skip(f"{spm_path} absent")
    spm = pytest.importorskip("sentencepiece")
    from tokenizers import Tokenizer

    src = save(make_model("olmoe"), tmp_path / "src", original=True)
    (src / "tokenizer.model").write_bytes(spm_path.read_bytes())
    (src / "chat_template.jinja").write_text("{{ messages }}")
    store = open_store(convert(src, tmp_path / "out", show_progress=False))
    assert set(store.manifest["tokenizer_files"]) >= {"tokenizer.json", "chat_template.jinja"}
    tok = Tokenizer.from_file(str(store.path / "tokenizer.json"))
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    for text in ["Hello world, this is Mixtral.", "new\nline ünïcode 12345 🦜 x"]:
        assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text)


SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_spm_model_tokenizer_needs_no_transformers(tmp_path):
    """spm_model_tokenizer (the .model file's protobuf read by colibri, the path taken without
    transformers) has sentencepiece's own pieces, scores and types, and tokenizes real text
    (C4, arXiv) exactly as the tokenizer.json transformers makes; a file that is not a model
    is a one-line ConversionError naming it."""
    import lzma

    from colibri.convert.hf import spm_model_tokenizer, spm_to_tokenizer_json
    from colibri.errors import ConversionError

    spm_path = SHARED / "tokenizers/mixtral_mistral/tokenizer.model.v1"
    if not spm_path.is_file():
        pytest.skip(f"{spm_path} absent")
    spm = pytest.importorskip("sentencepiece")
    from tokenizers import Tokenizer

    ours = spm_model_tokenizer(spm_path)
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    vocab = ours.get_vocab(with_added_tokens=True)
    assert len(vocab) == sp.get_piece_size() == 32000
    assert all(vocab[sp.id_to_piece(i)] == i for i in range(sp.get_piece_size()))
    theirs = Tokenizer.from_str(spm_to_tokenizer_json(spm_path).decode())
    texts = []
    for name in ("c4", "arxiv"):
        path = SHARED / "text" / f"olmoe_routing_{name}_texts.txt.xz"
        if path.is_file():
            with lzma.open(path, "rt") as f:
                texts += [t for t in f.read(200_000).split("\n") if t.strip()][:40]
    texts += ["Hello world, this is Mixtral.", "new\nline ünïcode 12345 🦜 x"]
    for text in texts:
        want = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False).ids == want
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\xff" * 12)
    with pytest.raises(ConversionError, match=r"tokenizer\.model: not a SentencePiece model"):
        spm_model_tokenizer(bad)
