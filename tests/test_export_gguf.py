"""colibri.export_gguf: a store written as GGUF carries the store's exact bytes, llama.cpp's
layout and metadata, and a vocabulary llama.cpp reads like its own converter writes it.

With a llama.cpp build (tools/build_llama_cpp.sh; never in CI) the same tiny Mixtral runs in
both transformers and llama.cpp and the last-token logits are compared.
"""

from __future__ import annotations

import json
import lzma
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGUFReader  # noqa: E402

from colibri.errors import ConversionError, StoreError  # noqa: E402
from colibri.export_gguf import bpe_pre_name, export_gguf, rope_permute, vocab_tokens  # noqa: E402
from colibri.io.format import open_store  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SPM_MODEL = SHARED / "tokenizers/mixtral_mistral/tokenizer.model.v1"
QWEN3_TOKENIZER = SHARED / "tokenizers/qwen/qwen3_tokenizer.json.xz"
QWEN2_VOCAB_GGUF = SHARED / "tokenizers/gguf_vocab/ggml-vocab-qwen2.gguf"
PROMPT = "The quick brown fox jumps over the lazy dog. Colibri streams experts"

MIXTRAL = dict(
    vocab_size=32000,  # the real Mixtral tokenizer
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    initializer_range=0.08,
    tie_word_embeddings=False,
)


def _convert():
    try:
        from colibri.convert import convert
    except ImportError:
        pytest.skip("colibri.convert is not available in this checkout")
    return convert


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip


def _gguf_kv(path: Path) -> dict:
    """The key/value section of a GGUF v2/v3 file, parsed straight from the spec (GGUFReader
    needs minutes for a 150k-token vocabulary on this machine)."""
    import struct

    buf = memoryview(path.read_bytes())
    magic, version, _, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF" and version in (2, 3)
    pos = 24

    def take(fmt: str):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    def value(vtype: int):
        nonlocal pos
        if vtype == 8:
            n = take("<Q")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8")
        if vtype == 9:
            sub, n = take("<I"), take("<Q")
            return [value(sub) for _ in range(n)]
        return take(_SCALARS[vtype])

    out = {}
    for _ in range(n_kv):
        key = value(8)
        out[key] = value(take("<I"))
    return out


# ---- the tiny model, its store and its GGUF ------------------------------------------------


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    """A tiny random HF Mixtral with the real Mixtral (SentencePiece) tokenizer, BOS added."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("sentencepiece")
    if not SPM_MODEL.is_file():
        pytest.skip(f"{SPM_MODEL} absent")
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("hf") / "tiny-mixtral"
    spm_dir = path.parent / "spm"
    spm_dir.mkdir()
    (spm_dir / "tokenizer.model").write_bytes(SPM_MODEL.read_bytes())
    (spm_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    tok = transformers.AutoTokenizer.from_pretrained(spm_dir, add_bos_token=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**MIXTRAL))
    model = model.float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms, so a norm mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random HF Qwen3-MoE (head_dim 32 != hidden / heads) with a byte-level BPE
    tokenizer trained here on real text, pre-tokenized with the Qwen2 regex."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from colibri.export_gguf import _QWEN2_RE
    from tests import hf_models

    text = SHARED / "text/olmoe_routing_c4_texts.txt.xz"
    if not text.is_file():
        pytest.skip(f"{text} absent")
    lines = lzma.decompress(text.read_bytes()).decode("utf-8").splitlines()[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_RE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=380, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(lines, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = hf_models.config("qwen3_moe", vocab_size=384)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("hf") / "tiny-qwen3moe"
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def _store(tmp_path_factory, model_dir: Path, quant: str, dense_quant: str) -> Path:
    out = tmp_path_factory.mktemp("store") / f"{model_dir.name}-{quant}-{dense_quant}"
    _convert()(model_dir, out, quant=quant, dense_quant=dense_quant, show_progress=False)
    return out


@pytest.fixture(scope="module")
def q4_store(tmp_path_factory, mixtral_dir) -> Path:
    return _store(tmp_path_factory, mixtral_dir, "q4_0", "q8_0")


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory, q4_store) -> Path:
    return export_gguf(q4_store, tmp_path_factory.mktemp("gguf") / "mixtral-q4_0.gguf")


@pytest.fixture(scope="module")
def q4_reader(q4_gguf) -> GGUFReader:
    return GGUFReader(q4_gguf)  # parsing 32000-entry arrays takes seconds: once per module


# ---- the RoPE row permutation ---------------------------------------------------------------


def _rope_hf(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """HF rotate-half RoPE on one head vector x [d]: pairs (i, i + d/2)."""
    d = x.shape[0]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[d // 2 :], x[: d // 2]])
    return x * cos + rot * sin


def _rope_ggml_normal(x: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """GGML's normal-mode RoPE (llama arch) on one head vector x [d]: pairs (2i, 2i + 1)."""
    d = x.shape[0]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    out = x.copy()
    out[0::2] = x[0::2] * np.cos(ang) - x[1::2] * np.sin(ang)
    out[1::2] = x[0::2] * np.sin(ang) + x[1::2] * np.cos(ang)
    return out


def test_rope_permute_turns_rotate_half_into_adjacent_pairs():
    """Permuted q/k rows under GGML's RoPE give the same heads, reordered, as the HF rows
    under HF's RoPE; the attention scores q.k are therefore equal."""
    rng = np.random.default_rng(0)
    n_head, d, n_embd = 3, 16, 24
    wq = rng.standard_normal((n_head * d, n_embd))
    x = rng.standard_normal(n_embd)
    wq_p = rope_permute(wq, n_head)
    for pos in (0, 1, 7, 100):
        for h in range(n_head):
            ref = _rope_hf(wq[h * d : (h + 1) * d] @ x, pos, 1e4)
            got = _rope_ggml_normal(wq_p[h * d : (h + 1) * d] @ x, pos, 1e4)
            perm = np.arange(d).reshape(2, d // 2).T.reshape(-1)  # 0, d/2, 1, d/2+1, ...
            np.testing.assert_allclose(got, ref[perm], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_rope_permute_commutes_with_row_quantization(qtype):
    """Permuting quantized rows equals quantizing the permuted float rows (gguf's quantizer)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4 * 2 * 8, 64)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    a = rope_permute(gguf.quants.quantize(w, t), 8)
    b = gguf.quants.quantize(rope_permute(w, 8), t)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ConversionError, match="RoPE-permute"):
        rope_permute(w[:24], 8)


# ---- bytes and metadata -------------------------------------------------------------------


def test_gguf_tensors_are_the_store_bytes(q4_store, q4_reader):
    store = open_store(q4_store)
    cfg = store.config
    reader = q4_reader
    tensors = {t.name: t for t in reader.tensors}
    n_layer, n_exp = cfg["num_hidden_layers"], store.num_experts
    assert len(tensors) == len(store.dense_names()) + 3 * n_layer
    ne = lambda t: tuple(int(x) for x in t.shape)  # noqa: E731  GGML order, fastest first

    emb, _, shape = store.dense("model.embed_tokens.weight")
    t = tensors["token_embd.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and ne(t) == shape[::-1]
    np.testing.assert_array_equal(np.asarray(t.data).reshape(emb.shape), emb)

    for layer in range(n_layer):
        p = f"model.layers.{layer}"
        for hf, name, heads in (
            ("self_attn.q_proj", "attn_q", cfg["num_attention_heads"]),
            ("self_attn.k_proj", "attn_k", cfg["num_key_value_heads"]),
            ("self_attn.v_proj", "attn_v", 0),
            ("self_attn.o_proj", "attn_output", 0),
        ):
            w, _, shape = store.dense(f"{p}.{hf}.weight")
            t = tensors[f"blk.{layer}.{name}.weight"]
            assert ne(t) == shape[::-1]
            if heads:  # rows regrouped head by head: (0, d/2, 1, d/2 + 1, ...)
                d = shape[0] // heads
                perm = np.arange(d).reshape(2, d // 2).T.reshape(-1)
                rows = (np.arange(heads)[:, None] * d + perm[None, :]).reshape(-1)
                w = w[rows]
            np.testing.assert_array_equal(np.asarray(t.data).reshape(w.shape), w)
        for hf, name in (
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "ffn_norm"),
        ):
            w, qt, _ = store.dense(f"{p}.{hf}.weight")
            t = tensors[f"blk.{layer}.{name}.weight"]
            assert qt == "f32" and t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(t.data), w)
        router = next(n for n in store.dense_names() if n.startswith(f"{p}.") and ".gate." in n)
        t = tensors[f"blk.{layer}.ffn_gate_inp.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(t.data), store.dense(router)[0])

        with open(store.experts_path, "rb") as f:
            records = [os.pread(f.fileno(), r.nbytes, r.offset)
                       for r in (store.record(layer, e) for e in range(n_exp))]  # fmt: skip
        for part in ("gate", "up", "down"):
            spec = store.layout.tensors[part]
            t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
            assert ne(t) == (spec.shape[1], spec.shape[0], n_exp)
            want = b"".join(r[spec.offset : spec.offset + spec.nbytes] for r in records)
            assert np.asarray(t.data).tobytes() == want

    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    out, _, _ = store.dense("lm_head.weight")
    np.testing.assert_array_equal(np.asarray(tensors["output.weight"].data).reshape(out.shape), out)


def test_gguf_metadata_is_llama_with_experts(q4_store, q4_reader):
    reader = q4_reader
    cfg = open_store(q4_store).config
    want = {
        "general.architecture": "llama",
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_0),
        "llama.block_count": cfg["num_hidden_layers"],
        "llama.embedding_length": cfg["hidden_size"],
        "llama.feed_forward_length": cfg["intermediate_size"],
        "llama.attention.head_count": cfg["num_attention_heads"],
        "llama.attention.head_count_kv": cfg["num_key_value_heads"],
        "llama.expert_count": cfg["num_local_experts"],
        "llama.expert_used_count": cfg["num_experts_per_tok"],
        "llama.rope.dimension_count": cfg["hidden_size"] // cfg["num_attention_heads"],
        "llama.context_length": cfg["max_position_embeddings"],
        "llama.vocab_size": cfg["vocab_size"],
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }
    got = {k: _field(reader, k) for k in want}
    assert got == want
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(1e4)
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 32000
    tj = json.loads((q4_store / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    assert all(tokens[i] == text for text, i in vocab.items())
    assert types[0] == gguf.TokenType.UNKNOWN and types[1] == types[2] == gguf.TokenType.CONTROL
    assert all(types[i] == gguf.TokenType.BYTE for i in range(3, 259))
    assert types[1000] == gguf.TokenType.NORMAL


def test_qwen3moe_gguf_bytes_and_metadata(qwen3_dir, tmp_path_factory, tmp_path):
    """Qwen3-MoE: arch qwen3moe, q/k rows NOT permuted (NeoX RoPE), q/k norms, expert
    feed-forward length and head_dim keys, byte-level "gpt2" vocabulary with merges."""
    store = open_store(_store(tmp_path_factory, qwen3_dir, "q8_0", "q8_0"))
    cfg = store.config
    reader = GGUFReader(export_gguf(store.path, tmp_path / "q.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn"
        for hf, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("q_norm", "attn_q_norm")):
            w = store.dense(f"{p}.{hf}.weight")[0]
            got = np.asarray(tensors[f"blk.{layer}.{name}.weight"].data).reshape(w.shape)
            np.testing.assert_array_equal(got, w)
        rec = store.record(layer, 5)
        with open(store.experts_path, "rb") as f:
            raw = os.pread(f.fileno(), rec.nbytes, rec.offset)
        spec = store.layout.tensors["down"]
        t = tensors[f"blk.{layer}.ffn_down_exps.weight"]
        got = np.asarray(t.data).reshape(store.num_experts, -1)[5].tobytes()
        assert got == raw[spec.offset : spec.offset + spec.nbytes]
    want = {
        "general.architecture": "qwen3moe",
        "qwen3moe.expert_count": store.num_experts,
        "qwen3moe.expert_used_count": cfg["num_experts_per_tok"],
        "qwen3moe.expert_feed_forward_length": cfg["moe_intermediate_size"],
        "qwen3moe.attention.key_length": cfg["head_dim"],
        "qwen3moe.attention.value_length": cfg["head_dim"],
        "qwen3moe.rope.dimension_count": cfg["head_dim"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
    }
    assert {k: _field(reader, k) for k in want} == want
    tj = json.loads((store.path / "tokenizer.json").read_text())
    assert _field(reader, "tokenizer.ggml.merges") == [" ".join(m) for m in tj["model"]["merges"]]
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tj["model"]["vocab"]["<|im_end|>"]


def test_qwen3moe_without_topk_renormalisation_is_refused(qwen3_dir, tmp_path_factory, tmp_path):
    import shutil

    src = _store(tmp_path_factory, qwen3_dir, "q8_0", "q8_0")
    other = tmp_path / "s"
    shutil.copytree(src, other)
    m = json.loads((other / "manifest.json").read_text())
    m["config"]["norm_topk_prob"] = False
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConversionError, match="norm_topk_prob"):
        export_gguf(other, tmp_path / "o.gguf")


# ---- vocabularies against independent sources --------------------------------------------


def test_spm_scores_keep_sentencepiece_merge_order(mixtral_dir):
    """The scores rebuilt from tokenizer.json's merges (transformers' conversion of the
    Mixtral tokenizer.model) order the mergeable pieces as the original SentencePiece
    model's scores do (pieces sentencepiece scores -1e9 aside)."""
    spm = pytest.importorskip("sentencepiece")
    tok = json.loads((mixtral_dir / "tokenizer.json").read_text())
    kind, tokens, scores, types = vocab_tokens(tok, 32000, "<unk>")
    sp = spm.SentencePieceProcessor(model_file=str(SPM_MODEL))
    assert kind == "llama" and tokens == [sp.id_to_piece(i) for i in range(32000)]
    merged = {a + b for a, b in tok["model"]["merges"]}
    ids = [i for i in range(32000) if tokens[i] in merged and sp.get_score(i) > -1e8]
    assert len(ids) > 28000  # all but single characters and the -1e9 pieces
    ours = np.array([scores[i] for i in ids])
    theirs = np.array([sp.get_score(i) for i in ids])
    assert (np.argsort(-ours, kind="stable") == np.argsort(-theirs, kind="stable")).all()
    assert [types[i] for i in (0, 1, 2, 3, 258)] == [2, 3, 3, 6, 6]


def test_bpe_vocab_matches_llama_cpp_qwen2_vocab():
    """The Qwen3 tokenizer.json exported as "gpt2" gives the tokens, types, merges and
    pre-tokenizer of llama.cpp's own qwen2 vocab file (same BPE, fewer added tokens)."""
    if not (QWEN3_TOKENIZER.is_file() and QWEN2_VOCAB_GGUF.is_file()):
        pytest.skip("shared Qwen tokenizer files absent")
    tok = json.loads(lzma.decompress(QWEN3_TOKENIZER.read_bytes()))
    ref = _gguf_kv(QWEN2_VOCAB_GGUF)
    ref_tokens, ref_types = ref["tokenizer.ggml.tokens"], ref["tokenizer.ggml.token_type"]
    kind, tokens, _, types = vocab_tokens(tok, 151936, None)
    assert kind == "gpt2" and bpe_pre_name(tok) == ref["tokenizer.ggml.pre"] == "qwen2"
    n_base = len(tok["model"]["vocab"])  # 151643 BPE tokens, then <|endoftext|>, <|im_...|>
    assert tokens[: n_base + 3] == ref_tokens[: n_base + 3]
    assert types[: n_base + 3] == ref_types[: n_base + 3]
    assert tokens[-1] == "[PAD151935]" and types[-1] == gguf.TokenType.UNUSED
    # merges as gguf.SpecialVocab writes them
    merges = [" ".join(m) for m in tok["model"]["merges"]]
    assert merges == ref["tokenizer.ggml.merges"]


# ---- refusals and atomicity ---------------------------------------------------------------


def test_refuses_existing_output_and_leaves_nothing_on_error(q4_store, tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep")
    with pytest.raises(ConversionError, match="already exists"):
        export_gguf(q4_store, out)
    assert out.read_bytes() == b"keep"

    # a corrupt expert record: checksum error, no output, no temporary file
    import shutil

    bad = tmp_path / "bad-store"
    shutil.copytree(q4_store, bad)
    store = open_store(bad)
    rec = store.record(1, 2)
    with open(store.experts_path, "r+b") as f:
        f.seek(rec.offset + 5)
        b = f.read(1)
        f.seek(rec.offset + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(StoreError, match="layer 1 expert 2"):
        export_gguf(bad, tmp_path / "y.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad-store", "x.gguf"]


def test_refuses_unsupported_model_type(q4_store, tmp_path):
    import shutil

    other = tmp_path / "s"
    shutil.copytree(q4_store, other)
    m = json.loads((other / "manifest.json").read_text())
    for model_type, why in (("qwen3_next", "qwen3next reorders"), ("made_up", "no architecture")):
        m["model_type"] = model_type
        (other / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ConversionError, match=f"'{model_type}' has no GGUF export: .*{why}"):
            export_gguf(other, tmp_path / "o.gguf")
        assert not (tmp_path / "o.gguf").exists()


# ---- same weights, two engines: llama.cpp vs transformers ---------------------------------


def _llama_bin() -> Path:
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["bash", str(root / "tools/build_llama_cpp.sh"), "--print"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is None or out.returncode != 0:
        pytest.skip("llama.cpp not built (run tools/build_llama_cpp.sh; CI never builds it)")
    return Path(out.stdout.strip())


def _llama_cpp_last_logits(gguf_path: Path, prompt: str, tmp: Path) -> tuple[list[int], np.ndarray]:
    exe = _llama_bin() / "llama-debug"
    if not exe.is_file():
        pytest.skip(f"{exe} missing (rebuild with tools/build_llama_cpp.sh)")
    cmd = [str(exe), "-m", str(gguf_path), "-p", prompt, "--save-logits",
           "--logits-output-dir", str(tmp), "-t", "1", "-c", "256", "-b", "256",
           "-ctk", "f32", "-ctv", "f32", "-fa", "off"]  # f32 KV, no f16 flash-attn  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    stem = tmp / f"llamacpp-{gguf_path.stem}"
    ids = np.fromfile(f"{stem}-tokens.bin", dtype=np.int32).tolist()
    return ids, np.fromfile(f"{stem}.bin", dtype=np.float32)


def _reference_logits(model_dir: Path, ids: list[int], quant: str, dense_quant: str) -> np.ndarray:
    """transformers' f32 last-token logits, with every weight the store quantizes replaced by
    its dequantized quantization (gguf.quants, byte-identical to colibri's quantizer)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith(("norm.weight", "mlp.gate.weight")):
                continue
            qtype = quant if ".experts." in name else dense_quant
            if qtype == "f32":
                continue
            t = gguf.GGMLQuantizationType[qtype.upper()]
            w = p.detach().numpy()
            p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t)))
        return model(torch.tensor([ids])).logits[0, -1].float().numpy()


@pytest.mark.parametrize(
    ("family", "quant", "dense_quant", "rtol"),
    [
        ("mixtral", "f32", "f32", 1e-5),
        ("mixtral", "q8_0", "q8_0", 5e-2),
        ("mixtral", "q4_0", "q8_0", 6e-2),
        ("qwen3moe", "f32", "f32", 1e-5),
        ("qwen3moe", "q8_0", "q8_0", 5e-2),
    ],
)
def test_llama_cpp_logits_match_transformers(
    request, tmp_path_factory, tmp_path, family, quant, dense_quant, rtol
):
    """llama.cpp on the exported GGUF and transformers on the same (dequantized) weights
    agree on the prompt's tokens and the last token's logits: max |diff| <= rtol * max |ref|.
    Quantized llama.cpp matmuls also round activations to q8_0, hence the looser bounds."""
    _llama_bin()
    transformers = pytest.importorskip("transformers")
    model_dir = request.getfixturevalue(f"{'mixtral' if family == 'mixtral' else 'qwen3'}_dir")
    store = _store(tmp_path_factory, model_dir, quant, dense_quant)
    path = export_gguf(store, tmp_path / f"tiny-{family}-{quant}.gguf")
    ids, got = _llama_cpp_last_logits(path, PROMPT, tmp_path / "out")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert ids == tok(PROMPT).input_ids
    ref = _reference_logits(model_dir, ids, quant, dense_quant)
    scale = float(np.abs(ref).max())
    err = float(np.abs(got - ref).max()) / scale
    assert err <= rtol, f"max |llama.cpp - transformers| / max |ref| = {err:.2e}"
    assert int(np.argmax(got)) == int(np.argmax(ref)) or err < rtol / 10
    msg = f"{family} {quant}/{dense_quant}: llama.cpp vs transformers {err:.2e}"
    ours = _colibri_last_logits(store, ids)
    if ours is not None:  # colibri itself on the store the GGUF was made from
        err_c = float(np.abs(ours - got).max()) / scale
        assert err_c <= rtol, f"max |colibri - llama.cpp| / max |ref| = {err_c:.2e}"
        msg += f", colibri vs llama.cpp {err_c:.2e}"
    print(msg)  # shown with pytest -s


def _colibri_last_logits(store: Path, ids: list[int]) -> np.ndarray | None:
    try:
        from colibri.engine import open_engine
    except ImportError:
        return None
    import asyncio

    async def run() -> np.ndarray:
        async with open_engine(store) as engine:
            return np.asarray(await engine.forward(engine.new_sequence(), ids), np.float32)

    return asyncio.run(run())
