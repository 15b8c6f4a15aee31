"""Real tokenizers from ../shared/data, laid out as model directories for the tokenizer tests.

Nothing is copied into the repository: each session unpacks the files into a temporary folder.
The Mixtral SentencePiece models are turned into tokenizer.json with transformers' own converter
(`SpmConverter.build_tokenizer_from_spm_proto`, legacy spaces like the hub's Mixtral files), and
their control pieces ([INST], ...) become special added tokens as `SpmConverter.tokenizer` does.
"""

from __future__ import annotations

import atexit
import functools
import json
import lzma
import shutil
import tempfile
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TOKENIZERS = DATA / "tokenizers"
NAMES = ("qwen3", "deepseek_v3", "olmoe", "mixtral_v1", "mixtral_v3")
MIXTRAL_MODELS = {
    "mixtral_v1": "tokenizer.model.v1",
    "mixtral_v3": "mistral_instruct_tokenizer_240323.model.v3",
}

# Real multilingual sentences and emoji (ZWJ sequences, flags, skin tones, combining marks).
MULTILINGUAL = [
    "Le cœur a ses raisons que la raison ne connaît point. Ça va très bien, merci!",
    "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？ 東京都は日本の首都です。",
    "안녕하세요, 만나서 반갑습니다. Привет, как дела? Γειά σου Κόσμε! مرحبا بالعالم",
    "नमस्ते दुनिया 🙏🏽 — emoji: 👩‍👩‍👧‍👦 🇫🇷🇯🇵 🦙🔥 ✔️ e\u0301 a\u0308 ﬁ Ⅻ ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "  leading spaces, tabs\tand\nnewlines\n\n   indented   code:\n\tdef f(x):\n\t\treturn x",
]


def require_data() -> None:
    if not TOKENIZERS.is_dir():
        pytest.skip(f"real-data folder {DATA} is absent (tests need ../shared/data)")


def real_text(n_chars: int = 1500) -> list[str]:
    """Excerpts of the real corpora: the start of each, and the c4 window richest in non-ASCII."""
    out = []
    for name in ("arxiv", "b3g", "c4"):
        path = DATA / "text" / f"olmoe_routing_{name}_texts.txt.xz"
        with lzma.open(path, "rt", encoding="utf-8") as f:
            text = f.read(400_000)
        out.append(text[:n_chars])
        if name in ("b3g", "c4"):
            starts = range(0, len(text) - n_chars, n_chars)
            best = max(starts, key=lambda s: sum(ord(c) > 127 for c in text[s : s + n_chars]))
            out.append(text[best : best + n_chars])
    return out


def _spm_tokenizer_json(model_file: Path, out_dir: Path) -> None:
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    write_spm_dir(proto, out_dir)


def write_spm_dir(proto, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json from a SentencePiece ModelProto, through
    transformers' converter, with <s> as BOS like the hub's Mixtral files."""
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter

    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    control = [
        AddedToken(p.piece, special=True, normalized=False) for p in proto.pieces if p.type == 3
    ]
    tok.add_special_tokens(control)
    # BOS in the post-processor, as in the hub's Mixtral tokenizer.json
    bos = ("<s>", vocab["<s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",  # load tokenizer.json as is in transformers 5
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def build_dirs(root: Path) -> dict[str, Path]:
    """One model-style directory per real tokenizer, under `root`."""
    dirs = {name: root / name for name in NAMES}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)

    def unxz(src: Path, dst: Path) -> None:
        with lzma.open(src, "rb") as f:
            dst.write_bytes(f.read())

    unxz(TOKENIZERS / "qwen" / "qwen3_tokenizer.json.xz", dirs["qwen3"] / "tokenizer.json")
    shutil.copyfile(
        TOKENIZERS / "qwen" / "qwen3_tokenizer_config.json",
        dirs["qwen3"] / "tokenizer_config.json",
    )
    unxz(TOKENIZERS / "deepseek_v3" / "tokenizer.json.xz", dirs["deepseek_v3"] / "tokenizer.json")
    shutil.copyfile(
        TOKENIZERS / "deepseek_v3" / "tokenizer_config.json",
        dirs["deepseek_v3"] / "tokenizer_config.json",
    )
    shutil.copyfile(
        TOKENIZERS / "olmoe" / "allenai_gpt-neox-olmo-dolma-v1_5.json",
        dirs["olmoe"] / "tokenizer.json",
    )
    for name, model in MIXTRAL_MODELS.items():
        _spm_tokenizer_json(TOKENIZERS / "mixtral_mistral" / model, dirs[name])
    for d in dirs.values():  # shared data is read-only; copies must be writable for tmp cleanup
        for f in d.iterdir():
            f.chmod(0o644)
    return dirs


@functools.cache
def built_dirs() -> dict[str, Path]:
    """`build_dirs` once per test process, in a temporary folder removed at exit."""
    require_data()
    pytest.importorskip("sentencepiece")
    root = Path(tempfile.mkdtemp(prefix="colibri-tokenizers-"))
    atexit.register(shutil.rmtree, root, True)
    return build_dirs(root)


@functools.cache
def hf_tokenizers() -> dict:
    """transformers' AutoTokenizer for each directory (the oracle)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return {n: transformers.AutoTokenizer.from_pretrained(d) for n, d in built_dirs().items()}


@functools.cache
def our_tokenizers() -> dict:
    from colibri.tokenizer import Tokenizer

    return {n: Tokenizer.from_dir(d) for n, d in built_dirs().items()}
