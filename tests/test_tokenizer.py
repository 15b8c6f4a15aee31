"""Tokenizer: encode/decode and special tokens against transformers (and SentencePiece itself for
Mixtral), llama.cpp's reference vectors, streaming detokenization, stop strings, file errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibri.errors import TokenizerError
from colibri.tokenizer import StopChecker, Tokenizer
from tests import tokenizer_data as td
from tests.tokenizer_data import MIXTRAL_MODELS, MULTILINGUAL, NAMES, TOKENIZERS, real_text

SPECIAL_TEXT = {
    "qwen3": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n",
    "deepseek_v3": "<｜begin▁of▁sentence｜>sys<｜User｜>Hi<｜Assistant｜>ok<｜end▁of▁sentence｜>",
    "olmoe": "Hi<|endoftext|>there<|padding|>",
    "mixtral_v1": "<s>[INST] Hi [/INST] ok</s>",
    "mixtral_v3": "<s>[INST] Hi [/INST] ok</s>[TOOL_CALLS]",
}


@pytest.fixture(scope="module")
def tokenizer_dirs():
    return td.built_dirs()


@pytest.fixture(scope="module")
def hf_tokenizers():
    return td.hf_tokenizers()


@pytest.fixture(scope="module")
def our_tokenizers():
    return td.our_tokenizers()


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    td.require_data()
    return [*MULTILINGUAL, *real_text(1500), "", " ", "a", "\n"]


# --- encode / decode vs transformers ------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_decode_match_transformers(
    name, add_special_tokens, corpus, hf_tokenizers, our_tokenizers
):
    hf, ours = hf_tokenizers[name], our_tokenizers[name]
    for text in [*corpus, SPECIAL_TEXT[name]]:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf(text, add_special_tokens=add_special_tokens)["input_ids"], repr(text[:80])
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_match_transformers(name, hf_tokenizers, our_tokenizers):
    hf, ours = hf_tokenizers[name], our_tokenizers[name]
    assert ours.special_tokens == hf.special_tokens_map
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    expected_eos = set() if hf.eos_token_id is None else {hf.eos_token_id}
    assert ours.eos_token_ids == expected_eos
    assert ours.vocab_size == len(hf)
    # a special token in the text is one token, as in transformers
    ids = ours.encode(SPECIAL_TEXT[name], add_special_tokens=False)
    assert len(ids) < len(SPECIAL_TEXT[name]) // 2


def test_bos_added_as_configured(our_tokenizers):
    assert our_tokenizers["mixtral_v1"].encode("Hi")[0] == 1  # tokenizer.json's post-processor
    assert our_tokenizers["mixtral_v1"].encode("Hi", add_special_tokens=False)[0] != 1
    ds = our_tokenizers["deepseek_v3"]  # add_bos_token: false in its config
    assert ds.bos_token_id not in ds.encode("Hi")


@pytest.mark.parametrize("name", list(MIXTRAL_MODELS))
def test_mixtral_matches_sentencepiece(name, corpus, tokenizer_dirs, our_tokenizers):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(
        model_file=str(TOKENIZERS / "mixtral_mistral" / MIXTRAL_MODELS[name])
    )
    ours = our_tokenizers[name]
    for text in corpus:
        ids = sp.encode(text)
        assert ours.encode(text) == [sp.bos_id(), *ids], repr(text[:80])
        assert ours.decode(ids) == sp.decode(ids)


def test_generation_config_eos_list(tmp_path, tokenizer_dirs):
    d = tmp_path / "mixtral"
    shutil.copytree(tokenizer_dirs["mixtral_v3"], d)
    gen = {"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 11}
    (d / "generation_config.json").write_text(json.dumps(gen))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == {2, 4}
    assert tok.bos_token_id == 1 and tok.pad_token_id == 11
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert Tokenizer.from_dir(d).eos_token_ids == {4, tok.token_to_id("</s>")}


def test_legacy_special_tokens_map(tmp_path, tokenizer_dirs):
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "tok"
    shutil.copytree(tokenizer_dirs["mixtral_v3"], d)
    (d / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "[/INST]", "lstrip": False}, "pad_token": "[INST]"})
    )
    ours, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    assert ours.special_tokens == hf.special_tokens_map
    assert ours.eos_token_ids == {hf.eos_token_id} == {ours.token_to_id("[/INST]")}
    assert ours.pad_token_id == hf.pad_token_id


# --- llama.cpp reference vectors ----------------------------------------------------------------


def _vectors(name: str) -> list[tuple[str, list[int]]]:
    # llama.cpp's format: inputs each followed by "\n__ggml_vocab_test__\n"; one line of ids each
    base = TOKENIZERS / "gguf_vocab" / f"ggml-vocab-{name}.gguf"
    texts = base.with_suffix(".gguf.inp").read_text(encoding="utf-8")
    texts = texts.split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""
    outs = base.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert outs[-1] == "" and len(outs) == len(texts)
    return [(t, [int(v) for v in o.split()]) for t, o in zip(texts[:-1], outs[:-1], strict=True)]


def _gguf_vocab(name: str) -> dict:
    """The tokenizer.* metadata of a vocab-only GGUF file. A direct read of the GGUF v3 key/value
    section: gguf.GGUFReader builds per-element views and needs a minute for Qwen2's merges."""
    gguf = pytest.importorskip("gguf")
    t = gguf.GGUFValueType
    numeric = {t.UINT8: "<u1", t.INT8: "<i1", t.UINT16: "<u2", t.INT16: "<i2", t.UINT32: "<u4",
               t.INT32: "<i4", t.FLOAT32: "<f4", t.BOOL: "?", t.UINT64: "<u8", t.INT64: "<i8",
               t.FLOAT64: "<f8"}  # fmt: skip
    buf = (TOKENIZERS / "gguf_vocab" / f"ggml-vocab-{name}.gguf").read_bytes()
    assert buf[:4] == b"GGUF" and np.frombuffer(buf, "<u4", 1, 4)[0] == 3
    n_kv = int(np.frombuffer(buf, "<u8", 1, 16)[0])
    pos = 24

    def read(kind, count=None):
        nonlocal pos
        if kind == t.STRING:
            out = []
            for _ in range(1 if count is None else count):
                n = int(np.frombuffer(buf, "<u8", 1, pos)[0])
                out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
                pos += 8 + n
            return out[0] if count is None else out
        arr = np.frombuffer(buf, numeric[kind], 1 if count is None else count, pos)
        pos += arr.nbytes
        return arr[0].item() if count is None else arr.tolist()

    meta = {}
    for _ in range(n_kv):
        key, kind = read(t.STRING), t(read(t.UINT32))
        if kind == t.ARRAY:
            item, count = t(read(t.UINT32)), read(t.UINT64)
            meta[key] = read(item, count)
        else:
            meta[key] = read(kind)
    return meta


def test_llamacpp_vectors_qwen2(our_tokenizers, tokenizer_dirs):
    """Qwen2's GGUF vocab and merges are Qwen3's: run its vectors through the real Qwen3 files."""
    meta = _gguf_vocab("qwen2")
    ours = our_tokenizers["qwen3"]
    tokens = meta["tokenizer.ggml.tokens"]
    base = 151643  # regular BPE vocab; added tokens follow and differ between the versions
    assert [ours.id_to_token(i) for i in range(base)] == tokens[:base]
    spec = json.loads((tokenizer_dirs["qwen3"] / "tokenizer.json").read_text(encoding="utf-8"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    assert merges == meta["tokenizer.ggml.merges"]
    vectors = _vectors("qwen2")
    assert len(vectors) == 46
    for text, expected in vectors:
        assert ours.encode(text, add_special_tokens=False) == expected, repr(text)


def test_llamacpp_vectors_llama_spm(tmp_path):
    """llama-spm (Llama 2 SentencePiece, like Mixtral's): a SentencePiece ModelProto is rebuilt
    from the GGUF pieces, scores and types (same enum), then converted like the Mixtral files."""
    td.require_data()
    spm = pytest.importorskip("sentencepiece")
    from transformers.convert_slow_tokenizer import import_protobuf

    meta = _gguf_vocab("llama-spm")
    proto = import_protobuf().ModelProto()
    for piece, score, kind in zip(
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"],
        meta["tokenizer.ggml.token_type"],
        strict=True,
    ):
        p = proto.pieces.add()
        p.piece, p.score, p.type = piece, score, kind
    proto.trainer_spec.model_type = 2  # BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = meta["tokenizer.ggml.unknown_token_id"]
    proto.trainer_spec.bos_id = meta["tokenizer.ggml.bos_token_id"]
    proto.trainer_spec.eos_id = meta["tokenizer.ggml.eos_token_id"]
    proto.trainer_spec.pad_id = -1
    norm = proto.normalizer_spec  # Llama 2's: identity, dummy prefix, spaces as "▁"
    norm.name, norm.add_dummy_prefix, norm.remove_extra_whitespaces = "identity", True, False
    norm.escape_whitespaces = True
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    td.write_spm_dir(proto, tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    vectors = _vectors("llama-spm")
    assert len(vectors) == 46
    for text, expected in vectors:
        assert sp.encode(text) == expected, repr(text)  # the rebuilt proto is faithful
        assert ours.encode(text, add_special_tokens=False) == expected, repr(text)
        assert ours.encode(text) == [meta["tokenizer.ggml.bos_token_id"], *expected]


# --- streaming detokenization -------------------------------------------------------------------


def _stream(tok: Tokenizer, ids, context=(), skip_special_tokens=False) -> list[str]:
    dec = tok.stream_decoder(context, skip_special_tokens=skip_special_tokens)
    deltas = [dec.push(i) for i in ids]
    return [*deltas, dec.flush()]


@pytest.mark.parametrize("name", NAMES)
def test_stream_reproduces_decode(name, corpus, our_tokenizers):
    tok = our_tokenizers[name]
    for text in [*corpus, SPECIAL_TEXT[name]]:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids), repr(text[:80])
        assert not any("\ufffd" in d for d in deltas)  # never a broken UTF-8 sequence
    ids = tok.encode(SPECIAL_TEXT[name])
    deltas = _stream(tok, ids, skip_special_tokens=True)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", NAMES)
def test_stream_after_every_token_boundary(name, our_tokenizers):
    """Prompt = ids[:k], generated = ids[k:], for every k: the deltas are exactly the new text."""
    tok = our_tokenizers[name]
    held_back = 0
    for text in MULTILINGUAL:
        ids = tok.encode(text, add_special_tokens=False)[:120]
        full = tok.decode(ids)
        mid_char = 0
        for k in range(len(ids) + 1):
            head = tok.decode(ids[:k])
            if not full.startswith(head):  # ids[:k] ends inside a character (byte pieces)
                mid_char += 1
                continue
            deltas = _stream(tok, ids[k:], context=ids[:k])
            assert "".join(deltas) == full[len(head) :], (text[:40], k)
            assert not any("\ufffd" in d for d in deltas)
            held_back += sum(d == "" for d in deltas[:-1])
        assert len(ids) + 1 - mid_char >= 10  # enough boundaries were checked
    assert held_back > 0  # some tokens completed no character: the hold-back path ran


def test_byte_fallback_is_exercised(our_tokenizers):
    tok = our_tokenizers["mixtral_v1"]
    ids = tok.encode(MULTILINGUAL[3], add_special_tokens=False)
    pieces = [tok.id_to_token(i) for i in ids]
    assert sum(p.startswith("<0x") for p in pieces) >= 8, pieces
    assert tok.decode([*ids[:1], tok.token_to_id("<0xE2>")]).endswith("\ufffd")
    dec = tok.stream_decoder()
    assert dec.push(tok.token_to_id("<0xE2>")) == ""
    assert dec.push(tok.token_to_id("<0x82>")) == ""
    assert dec.push(tok.token_to_id("<0xAC>")) == "€"
    assert dec.push(tok.token_to_id("<0xE2>")) == ""
    assert dec.flush() == "\ufffd"  # a truly incomplete sequence surfaces only at the end
    dec = tok.stream_decoder()
    for b in ("<0xE2>", "<0x82>", "<0xAC>", "<0xE2>"):
        dec.push(tok.token_to_id(b))
    assert dec.push(tok.token_to_id("▁Paris")) == "\ufffd Paris"  # shown "€" is not rewritten


def test_stream_keeps_sentencepiece_space_after_prompt(our_tokenizers):
    tok = our_tokenizers["mixtral_v1"]
    prompt = tok.encode("The capital of France is")
    dec = tok.stream_decoder(prompt)
    assert dec.push(tok.token_to_id("▁Paris")) == " Paris"
    assert tok.stream_decoder().push(tok.token_to_id("▁Paris")) == "Paris"  # no context: stripped


# --- stop strings -------------------------------------------------------------------------------


def _chunks(text: str, rng: np.random.Generator) -> list[str]:
    cuts = sorted(rng.choice(len(text) + 1, size=min(len(text), 12), replace=False).tolist())
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("seed", range(20))
def test_stop_checker_random_splits(seed):
    rng = np.random.default_rng(seed)
    text = "User: hi\nAssistant: hello there ###\nUser: more ## text"
    cases = [["###"], ["\nUser:"], ["zzz"], ["ere", "o t"], ["##", "###"], ["text"]]
    for stop in cases:
        hits = [text.find(s) for s in stop if s in text]
        expected = text[: min(hits)] if hits else text
        checker = StopChecker(stop)
        shown, stopped = "", False
        for chunk in _chunks(text, rng):
            out, stopped = checker.push(chunk)
            shown += out
            assert expected.startswith(shown)  # never shows text past or inside a stop string
            if stopped:
                break
        shown += checker.flush()
        assert stopped == bool(hits)
        assert shown == expected, (stop, shown)


def test_stop_checker_on_token_stream(our_tokenizers):
    tok = our_tokenizers["qwen3"]
    text = "Answer: 42.<|im_end|> and then garbage"
    dec, checker = tok.stream_decoder(skip_special_tokens=False), StopChecker(["<|im_end|>"])
    shown = ""
    for i in tok.encode(text, add_special_tokens=False):
        out, stopped = checker.push(dec.push(i))
        shown += out
        if stopped:
            break
    assert stopped and shown == "Answer: 42."
    with pytest.raises(TokenizerError):
        StopChecker([""])


# --- errors -------------------------------------------------------------------------------------


def test_missing_and_invalid_files(tmp_path, tokenizer_dirs):
    with pytest.raises(TokenizerError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing.*tokenizer\.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a valid"):
        Tokenizer.from_dir(tmp_path)
    shutil.copyfile(tokenizer_dirs["olmoe"] / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: expected a JSON object"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": 5}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: special token"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(TokenizerError, match=r"generation_config\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        tok.token_to_id("<no such token>")
