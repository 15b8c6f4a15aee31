"""GGUF -> store: expert blocks copied bit-exact, dense tensors renamed (and Q/K rows
un-permuted for llama-arch) and equal to the HF originals, config rebuilt from metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize as gq  # noqa: E402

from colibri.convert import convert  # noqa: E402
from colibri.errors import ConversionError  # noqa: E402
from colibri.io.format import open_store  # noqa: E402

H, I, E, L, NH, NKV, V = 64, 96, 4, 2, 4, 2, 128  # noqa: E741
HD = H // NH


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> GGUF rope)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, arch="llama", expert_type="Q4_0", extra=None, seed=0):
    """A tiny MoE GGUF; returns (HF-named float32 tensors, {(layer, role): GGUF expert bytes})."""
    rng = np.random.default_rng(seed)
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(256)
    w.add_rope_freq_base(1e6)
    if arch == "qwen3moe":
        w.add_chat_template("{{ messages }}")
        w.add_expert_feed_forward_length(I)
        w.add_key_length(HD)
        w.add_value_length(HD)
    router = "block_sparse_moe.gate" if arch == "llama" else "mlp.gate"
    hf: dict[str, np.ndarray] = {}
    exps: dict[tuple[int, str], np.ndarray] = {}

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def add(gname, hname, x, gx=None):
        hf[hname] = x
        w.add_tensor(gname, x if gx is None else gx)

    add("token_embd.weight", "model.embed_tokens.weight", f32(V, H))
    add("output_norm.weight", "model.norm.weight", f32(H))
    add("output.weight", "lm_head.weight", f32(V, H))
    for i in range(L):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", f32(H))
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", f32(H))
        q, k = f32(NH * HD, H), f32(NKV * HD, H)
        perm = arch == "llama"
        add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", q,
            llama_permute(q, NH) if perm else None)  # fmt: skip
        add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", k,
            llama_permute(k, NKV) if perm else None)  # fmt: skip
        add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", f32(NKV * HD, H))
        add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", f32(H, NH * HD))
        add(f"blk.{i}.ffn_gate_inp.weight", p + router + ".weight", f32(E, H))
        if arch == "qwen3moe":
            add(f"blk.{i}.attn_q_norm.weight", p + "self_attn.q_norm.weight", f32(HD))
            add(f"blk.{i}.attn_k_norm.weight", p + "self_attn.k_norm.weight", f32(HD))
        for role, shape in (("gate", (E, I, H)), ("up", (E, I, H)), ("down", (E, H, I))):
            x = f32(*shape) * 0.1
            q = x if expert_type == "F32" else gq(x, T[expert_type])
            exps[(i, role)] = np.ascontiguousarray(q).view(np.uint8).reshape(E, -1)
            if expert_type in ("F32", "F16"):
                w.add_tensor(f"blk.{i}.ffn_{role}_exps.weight", q)
            else:
                w.add_tensor(f"blk.{i}.ffn_{role}_exps.weight", q, raw_dtype=T[expert_type])
    for name, (arr, dtype) in (extra or {}).items():
        w.add_tensor(name, arr, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, exps


@pytest.mark.parametrize(
    "arch,expert_type", [("llama", "Q4_0"), ("llama", "Q4_1"), ("llama", "Q8_0"),
                         ("llama", "F16"), ("llama", "F32"), ("qwen3moe", "Q4_0")]
)  # fmt: skip
def test_gguf_experts_bit_exact_and_dense_match(arch, expert_type, tmp_path):
    src = tmp_path / "m.gguf"
    hf, exps = write_gguf(src, arch, expert_type)
    store = open_store(convert(src, tmp_path / "out", dense_quant="f32", show_progress=False))
    assert store.model_type == ("mixtral" if arch == "llama" else "qwen3_moe")
    cfg = store.config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (H, L, NKV)
    assert cfg.get("num_local_experts", cfg.get("num_experts")) == E
    assert store.layout.qtype == expert_type.lower()
    if arch == "qwen3moe":
        assert (store.path / "chat_template.jinja").read_text() == "{{ messages }}"
        assert store.manifest["tokenizer_files"] == ["chat_template.jinja"]
    blob = store.experts_path.read_bytes()
    for rec in store.records:
        raw = blob[rec.offset : rec.offset + rec.nbytes]
        for role in ("gate", "up", "down"):
            spec = store.layout.tensors[role]
            assert (
                raw[spec.offset : spec.offset + spec.nbytes]
                == exps[(rec.layer, role)][rec.expert].tobytes()
            ), (rec, role)
    assert set(store.dense_names()) == set(hf)
    for name, x in hf.items():  # f32 storage: exact, and q/k rows back in HF order
        arr, qtype, shape = store.dense(name)
        assert qtype == "f32" and tuple(shape) == x.shape
        np.testing.assert_array_equal(arr, x, err_msg=name)


def test_gguf_dense_q8_0_copied_or_requantized(tmp_path):
    """dense q8_0 output equals gguf's quantization of the HF tensor (q/k un-permuted)."""
    src = tmp_path / "m.gguf"
    hf, _ = write_gguf(src, "llama", "Q8_0")
    store = open_store(convert(src, tmp_path / "out", show_progress=False))
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ):
        arr, qtype, _ = store.dense(name)
        assert qtype == "q8_0"
        np.testing.assert_array_equal(arr, gq(hf[name], gguf.GGMLQuantizationType.Q8_0))


def test_gguf_unsupported_expert_type_refused(tmp_path):
    src = tmp_path / "k.gguf"
    kq = np.zeros((E, I, 66), np.uint8)  # one IQ2_XXS block (256 weights) a row
    write_gguf(src, extra={"blk.9.ffn_gate_exps.weight": (kq, gguf.GGMLQuantizationType.IQ2_XXS)})
    with pytest.raises(ConversionError, match=r"not supported yet: tensor blk\.9\.ffn_gate_exps"
                       r"\.weight has type IQ2_XXS"):  # fmt: skip
        convert(src, tmp_path / "out", show_progress=False)
    assert not list(tmp_path.glob("out*"))


def test_gguf_truncated(tmp_path):
    src = tmp_path / "t.gguf"
    write_gguf(src)
    data = src.read_bytes()
    src.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ConversionError, match=r"t\.gguf.*truncated"):
        convert(src, tmp_path / "out", show_progress=False)
    assert not list(tmp_path.glob("out*"))


def test_gguf_unsupported_arch(tmp_path):
    src = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(src), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConversionError, match="unsupported GGUF architecture 'gemma'"):
        convert(src, tmp_path / "out", show_progress=False)


VOCAB = Path(__file__).resolve().parents[2] / "shared/data/tokenizers/gguf_vocab"


def gguf_metadata(path: Path) -> dict:
    """The key/value metadata of a GGUF file (spec: ggml/docs/gguf.md), parsed directly:
    GGUFReader takes ~15 s of CPU on a 150k-token vocabulary, this ~0.5 s."""
    import struct

    data = path.read_bytes()
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
    scalar[12] = "d"
    pos = 0

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n : pos].decode("utf-8", "surrogateescape")

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            it, n = take("I"), take("Q")
            return [value(it) for _ in range(n)]
        return take(scalar[t])

    assert take("4s") == b"GGUF"
    take("I")  # version
    take("Q")  # tensor count
    return {string(): value(take("I")) for _ in range(take("Q"))}


def test_gguf_tokenizer_rebuilt_matches_llama_cpp_vectors():
    """tokenizer.json rebuilt from a real Qwen2 GGUF vocabulary reproduces llama.cpp's own
    reference tokenizations (the .inp/.out vectors shipped with llama.cpp)."""
    path = VOCAB / "ggml-vocab-qwen2.gguf"
    if not path.is_file():
        pytest.skip(f"{path} absent")
    from tokenizers import Tokenizer

    from colibri.convert.gguf import gguf_tokenizer_files

    files = dict(gguf_tokenizer_files(gguf_metadata(path), path))
    assert "<|im_start|>" in files["chat_template.jinja"].decode()
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    inputs = path.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    outputs = path.with_suffix(".gguf.out").read_text().split("\n")
    assert len(inputs) > 30
    for text, ids in zip(inputs, outputs, strict=False):
        assert tok.encode(text, add_special_tokens=False).ids == [int(x) for x in ids.split()]
    assert tok.encode("<|im_start|>user").ids[0] == 151644  # special token kept whole


@pytest.mark.parametrize("vocab", ["llama-spm", "deepseek-llm"])
def test_gguf_spm_and_deepseek_tokenizers_match_llama_cpp_vectors(vocab):
    """SentencePiece ("llama": byte fallback, space prefix, score-ranked merges) and the
    deepseek-llm pre-tokenizer (six chained regex splits) reproduce llama.cpp's vectors."""
    path = VOCAB / f"ggml-vocab-{vocab}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} absent")
    from tokenizers import Tokenizer

    from colibri.convert.gguf import gguf_tokenizer_files

    meta = gguf_metadata(path)
    tok = Tokenizer.from_str(dict(gguf_tokenizer_files(meta, path))["tokenizer.json"].decode())
    inputs = path.with_suffix(".gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    outputs = path.with_suffix(".gguf.out").read_text().split("\n")
    assert len(inputs) > 30
    for text, ids in zip(inputs, outputs, strict=False):
        assert tok.encode(text, add_special_tokens=False).ids == [int(x) for x in ids.split()], text
    tokens = meta["tokenizer.ggml.tokens"]
    control = [
        t for t, ty in zip(tokens, meta["tokenizer.ggml.token_type"], strict=True) if ty == 3
    ]
    assert control and tok.encode(control[0] + "hi", add_special_tokens=False).ids[
        0
    ] == tokens.index(control[0])  # special tokens kept whole
    text = "Hello world \U0001f999 ok" + (" wörld" if vocab == "llama-spm" else "")
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_gguf_unknown_pre_tokenizer_gets_no_tokenizer_json(capsys):
    path = VOCAB / "ggml-vocab-qwen2.gguf"
    if not path.is_file():
        pytest.skip(f"{path} absent")
    from colibri.convert.gguf import gguf_tokenizer_files

    meta = dict(gguf_metadata(path), **{"tokenizer.ggml.pre": "falcon"})
    assert [n for n, _ in gguf_tokenizer_files(meta, path)] == ["chat_template.jinja"]
    assert "no tokenizer.json made" in capsys.readouterr().err
