"""tools/train_demo.py: corpus, tokenizer files and both checkpoint layouts, on a 2-step run."""

import importlib.util
import itertools
import json
import math
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools" / "train_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


td = _load_tool()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step training run writing both layouts (takes ~15 s: corpus + BPE training)."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("demo")
    argv = ["--out", str(d / "hf"), "--fused-out", str(d / "fused"), "--steps", "2"]
    argv += ["--batch-size", "2", "--seq-len", "32", "--vocab-size", "512", "--no-samples"]
    td.main(argv)
    return d


def test_corpus_is_python_docs():
    from pydoc_data.topics import topics

    docs, chats = td.build_corpus()
    assert topics["for"].strip() in docs
    assert any(d.startswith("The Zen of Python") and "Beautiful is better" in d for d in docs)
    assert any(d.startswith("os.path.join\n\n") for d in docs)
    assert sum(map(len, docs)) > 1_000_000
    assert all([m["role"] for m in c] == ["user", "assistant"] for c in chats)
    assert td.build_corpus() == (docs, chats)  # deterministic


def test_lr_schedule_warmup_then_cosine_to_a_tenth():
    steps, peak, warmup = 100, 1e-3, 10
    lrs = [td.lr_at(s, steps, peak, warmup) for s in range(steps + 1)]
    assert lrs[0] == pytest.approx(peak / warmup) and lrs[warmup] == pytest.approx(peak)
    assert all(a <= b for a, b in itertools.pairwise(lrs[: warmup + 1]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[warmup:]))
    assert lrs[steps] == pytest.approx(peak / 10)
    mid = warmup + (steps - warmup) // 2
    assert lrs[mid] == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))))


def test_tokenizer_files(run):
    hf = run / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    text = 'The "for" statement is used to iterate — über ✓ 🐍\n    for i in range(10):'
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == text
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    expected = "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    assert rendered == expected + "<|im_start|>assistant\n"
    tcfg = json.loads((hf / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == (hf / "chat_template.jinja").read_text()
    assert (tcfg["bos_token"], tcfg["eos_token"]) == ("<s>", "</s>")
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["bos_token_id"] == tok.bos_token_id
    assert sorted(gen["eos_token_id"]) == sorted(tok.convert_tokens_to_ids(["</s>", "<|im_end|>"]))


def test_checkpoint_layouts_agree(run):
    cfg = json.loads((run / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["tie_word_embeddings"] is False
    n_ff, n_exp = cfg["intermediate_size"], cfg["num_local_experts"]
    orig = load_file(run / "hf" / "model.safetensors")
    fused = load_file(run / "fused" / "model.safetensors")
    for layer in range(cfg["num_hidden_layers"]):
        gate_up = fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = fused[f"model.layers.{layer}.mlp.experts.down_proj"]
        assert gate_up.shape == (n_exp, 2 * n_ff, cfg["hidden_size"])
        for e in range(n_exp):
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            assert torch.equal(orig[p + "w1.weight"], gate_up[e, :n_ff])  # gate
            assert torch.equal(orig[p + "w3.weight"], gate_up[e, n_ff:])  # up
            assert torch.equal(orig[p + "w2.weight"], down[e])
    x = torch.tensor([[0, 17, 42, 99, 3, 250]])
    logits = []
    for d in ("hf", "fused"):
        model = transformers.MixtralForCausalLM.from_pretrained(run / d).eval()
        with torch.no_grad():
            logits.append(model(input_ids=x).logits)
    assert torch.equal(logits[0], logits[1])
    assert json.loads((run / "hf" / "training.json").read_text())["steps"] == 2
