"""colibri eval against independent references.

- perplexity: the llama-perplexity method computed here with transformers on the same windows;
- multiple choice: lm-evaluation-harness itself (lm_eval 0.4.13, pinned as a test dependency)
  builds the requests from its own task yaml on real items, tokenizes them and scores them with
  its HFLM on the transformers model; its loglikelihoods, acc and acc_norm must equal colibri's;
- KL of a store against itself is 0 and routing agreement 1; q4_0 against f32 gives KL > 0;
- bad inputs give one clear line naming the file or field.
"""

from __future__ import annotations

import gzip
import json
import lzma
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.eval import scoring
from colibri.eval.cli import eval_choice, eval_perplexity
from colibri.eval.data import EvalError, read_records
from colibri.eval.tasks import build_requests
from tests import hf_models

torch = hf_models.torch
# ../shared/data beside the checkout (also from a worktree one level deeper, /work/wt/<name>)
SHARED = next(
    (p / "shared" / "data" for p in Path(__file__).resolve().parents[2:4]
     if (p / "shared" / "data").is_dir()),
    hf_models.SHARED,
)  # fmt: skip
EVAL = SHARED / "eval"
TEXT = SHARED / "text" / "olmoe_routing_c4_texts.txt.xz"
OLMOE_TOKENIZER = SHARED / "tokenizers" / "olmoe" / "allenai_gpt-neox-olmo-dolma-v1_5.json"
RTOL = 1e-4
# (family, tokenizer): the OLMoE tokenizer adds no BOS, the demo model's adds <s>
CASES = [("mixtral", "olmoe"), ("qwen3_moe", "olmoe"), ("mixtral", "demo")]
DEMO = Path(__file__).resolve().parents[1] / "colibri" / "data" / "demo"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared data missing: {path}")
    return path


def _records(name: str, n: int, keep=lambda r: True) -> list[dict]:
    out = []
    with lzma.open(_need(EVAL / name), "rt") as f:
        for line in f:
            r = json.loads(line)
            if keep(r):
                out.append(r)
                if len(out) == n:
                    break
    return out


def _text(nchars: int = 6000) -> str:
    with lzma.open(_need(TEXT), "rt") as f:
        return f.read(nchars)


def _save_with_tokenizer(model_type: str, tokenizer: str, path: Path, seed: int):
    """A tiny random model (tests/hf_models.py's config, norms perturbed) whose vocabulary is
    a real tokenizer's (OLMoE: 50304 ids; the demo model's: 2048), saved with its files."""
    if tokenizer == "olmoe":
        tok, vocab = _need(OLMOE_TOKENIZER), 50304
        tok_config = json.dumps({"eos_token": "<|endoftext|>"})
    else:
        tok, vocab = DEMO / "tokenizer.json", 2048
        tok_config = (DEMO / "tokenizer_config.json").read_text()
    if hasattr(hf_models, "config"):  # test cases declared by the families (models/*.py)
        config = hf_models.config(model_type, vocab_size=vocab)
    else:
        cls_name, extra = {**hf_models.CONFIGS, **hf_models.EXTRA_CONFIGS}[model_type]
        config = getattr(hf_models.transformers, cls_name)(
            **{**hf_models.COMMON, **extra, "vocab_size": vocab}
        )
    torch.manual_seed(seed)
    model = hf_models.transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_bytes(tok.read_bytes())
    (path / "tokenizer_config.json").write_text(tok_config)
    return model


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def tiny(request, tmp_path_factory):
    """(family, transformers model, its HF folder, its f32 store), a real tokenizer."""
    family, tokenizer = request.param
    root = tmp_path_factory.mktemp(family)
    model = _save_with_tokenizer(family, tokenizer, root / "hf", seed=7)
    store = convert(root / "hf", root / "f32", quant="f32", dense_quant="f32", show_progress=False)
    return f"{family}-{tokenizer}", model, root / "hf", store


# ---- perplexity ---------------------------------------------------------------------------


def _hf_nll(model, windows: list[list[int]], first: int) -> np.ndarray:
    out = []
    for w in windows:
        with torch.no_grad():
            logits = model(torch.tensor([w])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)[first:-1]
        out.append(-lp[torch.arange(len(w) - 1 - first), torch.tensor(w[first + 1 :])].numpy())
    return np.concatenate(out)


async def test_perplexity_matches_transformers(tiny):
    family, model, hf, store = tiny
    from transformers import PreTrainedTokenizerFast

    text, n_ctx = _text(), 48
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"))
    plain = hf_tok(text, add_special_tokens=False)["input_ids"]
    with_bos = hf_tok(text)["input_ids"]
    bos = with_bos[0] if len(with_bos) > len(plain) else None  # the tokenizer adds BOS
    assert (bos is not None) == family.endswith("demo")
    # llama-perplexity: BOS in front, then every window's first token replaced by BOS
    ids = ([bos] if bos is not None else []) + plain
    windows = [ids[i * n_ctx : (i + 1) * n_ctx] for i in range(3)]
    if bos is not None:
        windows = [[bos, *w[1:]] for w in windows]
    nll = _hf_nll(model, windows, n_ctx // 2)
    ppl = float(np.exp(nll.mean()))
    async with open_engine(store, n_ctx=n_ctx, activations="f32") as engine:
        res = await eval_perplexity(engine, text, n_ctx, limit=3, show_progress=False)
        engine.prefill_chunk = 10  # windows fed in several chunks, one wholly unscored
        chunked = await eval_perplexity(engine, text, n_ctx, limit=3, show_progress=False)
    m = res["metrics"]
    assert chunked["metrics"]["ppl"] == pytest.approx(ppl, rel=RTOL)
    assert m["tokens_scored"] == 3 * (n_ctx - 1 - n_ctx // 2) == len(nll)
    assert abs(m["ppl"] - ppl) <= RTOL * ppl, (family, m["ppl"], ppl)
    # llama-perplexity's error: PPL * sqrt(var(nll) / (count - 1)), var with 1/count
    err = ppl * np.sqrt(nll.var() / (len(nll) - 1))
    assert abs(m["ppl_stderr"] - err) <= 1e-3 * err


def test_windows_replace_bos():
    ws = scoring.windows(list(range(10, 30)), 8, bos=1)
    assert ws == [[1, *range(11, 18)], [1, *range(19, 26)]]  # remainder of 4 dropped
    assert scoring.windows(list(range(10, 30)), 8, bos=None, limit=1) == [list(range(10, 18))]


async def test_kl_self_is_zero_and_q4_positive(tiny, tmp_path):
    _family, _model, hf, store = tiny
    q4 = convert(hf, tmp_path / "q4", quant="q4_0", dense_quant="f32", show_progress=False)
    text = _text()
    async with (
        open_engine(store, n_ctx=32, activations="f32") as engine,
        open_engine(store, n_ctx=32, activations="f32") as same,
        open_engine(q4, n_ctx=32, activations="f32") as quant,
    ):
        self_res = await eval_perplexity(engine, text, 32, reference=same, limit=2,
                                         show_progress=False)  # fmt: skip
        q_res = await eval_perplexity(quant, text, 32, reference=engine, limit=2,
                                      show_progress=False)  # fmt: skip
    s, q = self_res["metrics"], q_res["metrics"]
    n_moe = sum(1 for layer in engine.spec.layers if layer.moe)
    assert s["kl_max"] == 0.0 and s["top1_agreement"] == 1.0
    assert s["routing_agreement"] == [1.0] * n_moe and s["routing_overlap"] == [1.0] * n_moe
    assert q["kl_mean"] > 0 and q["kl_max"] >= q["kl_p99"] >= q["kl_median"] >= 0
    assert len(q["routing_agreement"]) == n_moe
    pairs = zip(q["routing_agreement"], q["routing_overlap"], strict=True)
    assert all(0 <= a <= o <= 1 for a, o in pairs)
    assert q["reference_ppl"] == pytest.approx(s["ppl"], rel=1e-12)


# ---- multiple choice against lm-evaluation-harness ------------------------------------------

try:
    import lm_eval
except ImportError:  # a test dependency (pyproject.toml); without it these tests skip
    lm_eval = None
needs_lm_eval = pytest.mark.skipif(lm_eval is None, reason="lm_eval is not installed")


def _lm_eval_task(yaml_rel: str, splits: dict[str, Path], tmp_path: Path, **over):
    """lm-eval's own ConfigurableTask from its installed yaml, on local JSON files."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(Path(lm_eval.__file__).parent / "tasks" / yaml_rel)
    cfg = dict(cfg, dataset_path="json", dataset_name=None, **over)
    cfg["dataset_kwargs"] = {"data_files": {k: str(v) for k, v in splits.items()}}
    for split in ("training_split", "validation_split", "test_split", "fewshot_split"):
        if cfg.get(split) not in splits:
            cfg[split] = None
    return ConfigurableTask(config=cfg, cache_dir=str(tmp_path / "hf_datasets"))


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# a few items per task: real ones where ../shared/data/eval has the dataset; otherwise items
# written here in the dataset's own fields (ARC, PIQA, Winogrande, OpenBookQA are not shipped)
HANDMADE = {
    "arc_easy": [
        {"id": "x1", "question": "Which gas do plants take in for photosynthesis?",
         "choices": {"text": ["oxygen", "carbon dioxide", "nitrogen", "helium"],
                     "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
        {"id": "x2", "question": "What is frozen water called?",
         "choices": {"text": ["steam", "ice", "fog"], "label": ["1", "2", "3"]},
         "answerKey": "2"},
    ],
    "piqa": [
        {"goal": "To dry wet shoes,", "sol1": "stuff them with newspaper.",
         "sol2": "put them in the freezer.", "label": 0},
    ],
    "winogrande": [
        {"sentence": "The trophy doesn't fit into the suitcase because the _ is too large.",
         "option1": "trophy", "option2": "suitcase", "answer": "1"},
        {"sentence": "Sarah lent Maria a book because _ had finished reading it.",
         "option1": "Sarah", "option2": "Maria", "answer": "1"},
    ],
    "openbookqa": [
        {"id": "o1", "question_stem": "A magnet will stick to",
         "choices": {"text": ["a wooden door", "a steel fridge", "glass", "paper"],
                     "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
    ],
}  # fmt: skip
YAML = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "sciq": "sciq/sciq.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
}
REAL = {"hellaswag": "hellaswag_validation.jsonl.xz", "sciq": "sciq_validation.jsonl.xz",
        "boolq": "boolq_validation.jsonl.xz"}  # fmt: skip


def _docs(task: str, n: int, max_chars: int = 10**9) -> list[dict]:
    if task in REAL:
        docs = _records(REAL[task], n, lambda r: len(json.dumps(r)) < max_chars)
        if task == "boolq":  # super_glue/boolq (lm-eval's) calls google/boolq's answer label
            docs = [{**d, "label": int(d.pop("answer"))} for d in docs]
        return docs
    return HANDMADE["arc_easy" if task == "arc_challenge" else task]


def _lm_eval_requests(task: str, docs: list[dict], tmp_path: Path, shots: int = 0, dev=None):
    split = "test" if task.startswith("mmlu") else "validation"
    files = {split: _jsonl(tmp_path / f"{split}.jsonl", docs)}
    if dev is not None:
        files["dev"] = _jsonl(tmp_path / "dev.jsonl", dev)
    t = _lm_eval_task(YAML.get(task, f"mmlu/default/{task}.yaml"), files, tmp_path)
    lm_docs = list(t.test_docs() if split == "test" else t.validation_docs())
    out = []
    for i, d in enumerate(lm_docs):
        ctx = t.fewshot_context(d, shots)
        inst = t.construct_requests(d, ctx, metadata=(task, i, 1))
        out.append((t, d, [r.args for r in inst]))
    return out


@needs_lm_eval
@pytest.mark.parametrize("task", sorted(YAML))
def test_prompts_equal_lm_eval(task, tmp_path):
    docs = _docs(task, 4)
    ours = build_requests(task, docs, "test")
    theirs = _lm_eval_requests(task, docs, tmp_path)
    assert len(ours) == len(theirs)
    for r, (_t, d, args) in zip(ours, theirs, strict=True):
        assert list(zip(r.contexts, r.continuations, strict=True)) == list(args)
        # winogrande's gold index is its doc_to_text (a "multiple input" task)
        gold = _t.doc_to_text(d) if task == "winogrande" else _t.doc_to_target(d)
        assert r.gold == gold


@needs_lm_eval
@pytest.mark.parametrize("shots", [0, 2])
def test_mmlu_prompts_equal_lm_eval(shots, tmp_path):
    subject = "high_school_biology"
    docs = _records("mmlu_test.jsonl.xz", 3, lambda r: r["subject"] == subject)
    dev = _records("mmlu_dev.jsonl.xz", 5, lambda r: r["subject"] == subject)
    ours = build_requests("mmlu", docs, "test", shots=shots, fewshot_docs=dev)
    theirs = _lm_eval_requests(f"mmlu_{subject}", docs, tmp_path, shots, dev)
    for r, (_t, _d, args) in zip(ours, theirs, strict=True):
        assert list(zip(r.contexts, r.continuations, strict=True)) == list(args)


@pytest.fixture(scope="module")
def hflm(tiny):
    """lm-eval's HFLM on the transformers model with the store's tokenizer (f32)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedTokenizerFast

    _family, model, hf, _store = tiny
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    special = {k: cfg[k] for k in ("bos_token", "eos_token") if cfg.get(k)}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"), **special)
    return HFLM(pretrained=model, tokenizer=tok, batch_size=1, device="cpu")


@needs_lm_eval
@pytest.mark.parametrize("task", ["hellaswag", "winogrande", "boolq", "mmlu"])
async def test_choice_logprobs_equal_lm_eval(task, tiny, hflm, tmp_path):
    from lm_eval.api.instance import Instance

    family, _model, _hf, store = tiny
    if task == "mmlu":
        docs = _records("mmlu_test.jsonl.xz", 3, lambda r: r["subject"] == "virology")
        dev = _records("mmlu_dev.jsonl.xz", 5, lambda r: r["subject"] == "virology")
        theirs = _lm_eval_requests("mmlu_virology", docs, tmp_path, 1, dev)
    else:
        docs, dev = _docs(task, 3, max_chars=550), None  # the tiny models: 256 positions
        theirs = _lm_eval_requests(task, docs, tmp_path)
    async with open_engine(store, activations="f32") as engine:
        res = await eval_choice(engine, task, docs, "test", shots=1 if dev else 0,
                                fewshot_docs=dev, show_progress=False)  # fmt: skip
    acc, acc_norm = [], []
    for item, (t, d, args) in zip(res["items"], theirs, strict=True):
        inst = [Instance("loglikelihood", d, a, i) for i, a in enumerate(args)]
        lls = [ll for ll, _greedy in hflm.loglikelihood(inst, disable_tqdm=True)]
        np.testing.assert_allclose(item["logprobs"], lls, rtol=RTOL, err_msg=f"{family} {task}")
        metrics = t.process_results(d, [(ll, False) for ll in lls])
        acc.append(metrics["acc"])
        acc_norm.append(metrics.get("acc_norm"))
        assert item["pred"] == int(np.argmax(lls))
    assert res["metrics"]["acc"] == pytest.approx(np.mean(acc))
    assert res["metrics"]["acc_stderr"] == pytest.approx(np.std(acc, ddof=1) / np.sqrt(len(acc)))
    if "acc_norm" in res["metrics"]:
        assert res["metrics"]["acc_norm"] == pytest.approx(np.mean(acc_norm))


async def test_shared_prefix_equals_separate_runs(tiny):
    """score_requests feeds the shared prefix once and rewinds: same logprobs as scoring each
    request in a fresh sequence."""
    _family, _model, _hf, store = tiny
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 2048, 20).tolist()
    conts = [rng.integers(0, 2048, n).tolist() for n in (1, 5, 3)]
    async with open_engine(store, activations="f32") as engine:
        shared = await scoring.continuation_logprobs(engine, ctx, conts)
        alone = [(await scoring.score_requests(engine, [(ctx, c)]))[0] for c in conts]
        for c, lp in zip(conts, shared, strict=True):  # and from full logits of one pass
            seq = engine.new_sequence()
            rows = await engine.forward(seq, ctx + c[:-1], all_logits=True)
            full = scoring.log_softmax(rows[len(ctx) - 1 :])[np.arange(len(c)), c]
            np.testing.assert_allclose(lp, full, rtol=1e-6)
    for a, b in zip(shared, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


async def test_batched_items_equal_one_at_a_time(tiny):
    """score_items batches items (their prefixes, then every choice's continuation from a
    fork of its prefix's KV cache, in chunks): in split mode each log-probability is
    bit-identical to scoring the item alone; in fused mode equal to 1e-5."""
    _family, _model, _hf, store = tiny
    rng = np.random.default_rng(1)
    items = []
    for n_ctx, lens in [(20, (1, 5, 3)), (7, (4, 4)), (33, (2,)), (12, (6, 1, 2, 9))]:
        ctx = rng.integers(0, 2048, n_ctx).tolist()
        items.append([(ctx, rng.integers(0, 2048, n).tolist()) for n in lens])
    # winogrande-like: contexts that differ, a shared continuation
    cont = rng.integers(0, 2048, 5).tolist()
    base = rng.integers(0, 2048, 9).tolist()
    items.append([([*base, 3], cont), ([*base, 4, 5], cont)])
    for batch in ("split", "fused"):
        async with open_engine(store, activations="f32", batch=batch) as engine:
            engine.prefill_chunk = 8  # prefixes and continuations cut in several chunks
            alone = [await scoring.score_requests(engine, reqs) for reqs in items]
            batched = await scoring.score_items(engine, items, max_batch=5)
        for a, b in zip(alone, batched, strict=True):
            for x, y in zip(a, b, strict=True):
                if batch == "split":
                    assert np.array_equal(x, y)
                else:
                    np.testing.assert_allclose(x, y, rtol=1e-5)


async def test_choice_reference(tiny, tmp_path):
    """--reference on a multiple-choice task: a store against itself agrees everywhere;
    q4_0 against f32 reports the accuracy delta and agreement its items imply."""
    _family, _model, hf, store = tiny
    q4 = convert(hf, tmp_path / "q4", quant="q4_0", dense_quant="f32", show_progress=False)
    docs = _docs("sciq", 6, max_chars=550)
    async with (
        open_engine(store, activations="f32") as engine,
        open_engine(store, activations="f32") as same,
        open_engine(q4, activations="f32") as quant,
    ):
        self_res = await eval_choice(engine, "sciq", docs, "t", reference=same,
                                     show_progress=False)  # fmt: skip
        q_res = await eval_choice(quant, "sciq", docs, "t", reference=engine,
                                  show_progress=False)  # fmt: skip
    m = self_res["metrics"]
    assert m["acc_delta"] == m["acc_norm_delta"] == 0.0
    assert m["pred_agreement"] == m["pred_norm_agreement"] == 1.0
    assert m["reference_acc"] == m["acc"]
    for it in self_res["items"]:
        assert it["reference_logprobs"] == it["logprobs"]
    m, items = q_res["metrics"], q_res["items"]
    for it, f32 in zip(items, self_res["items"], strict=True):
        assert it["reference_logprobs"] == f32["logprobs"]
        assert it["reference_pred"] == int(np.argmax(f32["logprobs"]))
        assert it["logprobs"] != f32["logprobs"]
    ours = np.array([it["pred"] == it["gold"] for it in items], float)
    ref = np.array([it["reference_pred"] == it["gold"] for it in items], float)
    assert m["acc_delta"] == pytest.approx(ours.mean() - ref.mean())
    assert m["reference_acc"] == pytest.approx(ref.mean())
    diff = ours - ref
    assert m["acc_delta_stderr"] == pytest.approx(np.std(diff, ddof=1) / np.sqrt(len(diff)))
    agree = np.mean([it["pred"] == it["reference_pred"] for it in items])
    assert m["pred_agreement"] == pytest.approx(agree)


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v32", "gpt_oss", "qwen3_next"])
async def test_forked_choices_other_families(case, tmp_path):
    """Forked KV caches on other attention kinds (MLA's latent cache, DSA's indexer keys,
    sliding windows with sinks, Gated DeltaNet's recurrent state): every choice's
    log-probabilities from score_items equal transformers' on the whole sequence."""
    model = hf_models.build(case, seed=2)
    store = convert(hf_models.save(model, tmp_path / "hf"), tmp_path / "f32", quant="f32",
                    dense_quant="f32", show_progress=False)  # fmt: skip
    rng = np.random.default_rng(3)
    vocab = model.config.get_text_config().vocab_size
    items = []
    for n_ctx, lens in [(13, (3, 1, 4)), (6, (2, 5))]:
        ctx = rng.integers(0, vocab, n_ctx).tolist()
        items.append([(ctx, rng.integers(0, vocab, n).tolist()) for n in lens])
    async with open_engine(store, activations="f32") as engine:
        got = await scoring.score_items(engine, items)
    for reqs, lps in zip(items, got, strict=True):
        for (ctx, cont), lp in zip(reqs, lps, strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont])).logits[0].double()
            want = torch.log_softmax(logits, -1)[len(ctx) - 1 : -1]
            want = want[torch.arange(len(cont)), torch.tensor(cont)].numpy()
            np.testing.assert_allclose(lp, want, rtol=RTOL, atol=1e-6, err_msg=case)


async def test_forward_batch_and_fork():
    """Engine.forward_batch of forks of one prefix equals forward() of each continuation
    after the prefix in its own sequence (split mode: bit-identical); bad input names the
    sequence."""
    from colibri.errors import ColibriError

    async with open_engine(DEMO, n_ctx=64, batch="split") as engine:
        prefix, conts = [1, 50, 60, 70], [[80, 90], [81], [82, 83, 84]]
        base = engine.new_sequence()
        await engine.forward(base, prefix)
        forks = [base.fork() for _ in conts]
        got = await engine.forward_batch(forks, conts, [True, False, True], [1, 0, 0])
        for c, g, full, first in zip(conts, got, [True, False, True], [1, 0, 0], strict=True):
            alone = engine.new_sequence()
            await engine.forward(alone, prefix)
            want = await engine.forward(alone, c, all_logits=full, logits_from=first)
            assert np.array_equal(g, want)
        assert [f.tokens for f in forks] == [prefix + c for c in conts]
        assert base.tokens == prefix and base.length == len(prefix)  # the forks are copies
        with pytest.raises(ColibriError, match="sequence 1: token id 99999"):
            await engine.forward_batch([base.fork(), base.fork()], [[1], [99999]])
        with pytest.raises(ColibriError, match="sequence 0 has no tokens"):
            await engine.forward_batch([base.fork()], [[]])
        with pytest.raises(ColibriError, match="sequence 0: 65 tokens exceed"):
            await engine.forward_batch([base.fork()], [[5] * 61])


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, in float64 throughout (numpy)."""
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


@pytest.mark.parametrize("batch", ["split", "fused"])
async def test_forward_batch_targets_give_the_log_softmax_at_them(batch, monkeypatch):
    """forward_batch with targets returns log-softmax(logits)[target] per scored row (float64;
    checked against the same engine's logits, log-softmax in float64 here) for every
    sequence that asks, in blocks of rows smaller than the span (HEAD_BLOCK_NBYTES shrunk to
    8 rows), beside sequences that want logits or the last row (unchanged); bad targets
    name the sequence."""
    from colibri import pipeline
    from colibri.errors import ColibriError

    monkeypatch.setattr(pipeline, "HEAD_BLOCK_NBYTES", 8 * 4 * 2048)  # demo vocab: 8 rows
    rng = np.random.default_rng(3)
    async with open_engine(DEMO, n_ctx=64, batch=batch) as engine:
        prefix = [1, 50, 60, 70]
        conts = [rng.integers(3, 2048, n).tolist() for n in (21, 5, 13)]
        froms = [0, 2, 0]
        targets = [[*c[1 + f :], 7] for c, f in zip(conts, froms, strict=True)]
        base = engine.new_sequence()
        await engine.forward(base, prefix)

        async def run(full, tgts=()):
            forks = [base.fork() for _ in conts]
            return await engine.forward_batch(forks, conts, full, froms, tgts)

        logits = await run([True, True, True])
        want = [_log_softmax64(x)[np.arange(len(t)), t] for x, t in zip(logits, targets, strict=True)]  # fmt: skip  # noqa: E501
        for g, w in zip(await run([True, True, True], targets), want, strict=True):
            assert g.dtype == np.float64 and g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
        mixed = await run([True, True, False], [targets[0], None, None])
        np.testing.assert_allclose(mixed[0], want[0], rtol=0, atol=1e-6)
        plain = await run([True, True, False])
        assert np.array_equal(mixed[1], plain[1]) and np.array_equal(mixed[2], plain[2])
        with pytest.raises(ColibriError, match="sequence 0: targets need all_logits"):
            await engine.forward_batch([base.fork()], [[1, 2]], [False], [0], [[3, 4]])
        with pytest.raises(ColibriError, match=r"sequence 0: targets need .* \(2\), got 1"):
            await engine.forward_batch([base.fork()], [[1, 2]], [True], [0], [[3]])
        with pytest.raises(ColibriError, match="sequence 1: target id 5000"):
            await engine.forward_batch(
                [base.fork(), base.fork()], [[1], [2]], [True, True], [0, 0], [[3], [5000]]
            )


# ---- CLI, JSON and inputs -----------------------------------------------------------------


def test_cli_json_schema(tmp_path, capsys):
    out = tmp_path / "hs.json"
    data = _need(EVAL / "hellaswag_validation.jsonl.xz")
    assert main(["eval", "--task", "hellaswag", "--data", str(data), "--limit", "4",
                 "--json", str(out)]) == 0  # fmt: skip
    r = json.loads(out.read_text())
    assert r["task"] == "hellaswag" and r["n"] == 4 and len(r["items"]) == 4
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} == set(r["metrics"])
    assert {"tokens_per_second", "hit_rate", "bytes_read"} <= set(r["statistics"])
    for it in r["items"]:
        assert len(it["logprobs"]) == len(it["nchars"]) == 4
        assert it["pred"] == int(np.argmax(it["logprobs"]))
    assert "acc 0." in capsys.readouterr().out
    assert main(["eval", "--task", "hellaswag", "--data", str(data), "--limit", "1"]) == 0
    assert " over 1 item\n" in capsys.readouterr().out
    assert main(["eval", "--task", "hellaswag", "--data", str(data), "--limit", "2",
                 "--reference", str(DEMO), "--json", str(out)]) == 0  # fmt: skip
    r = json.loads(out.read_text())
    assert r["reference"] == str(DEMO)
    assert {
        "reference_acc",
        "acc_delta",
        "acc_delta_stderr",
        "pred_agreement",
        "reference_acc_norm",
        "acc_norm_delta",
        "pred_norm_agreement",
    } <= set(r["metrics"])
    assert r["metrics"]["pred_agreement"] == 1.0  # the demo against itself
    assert {"reference_logprobs", "reference_pred", "reference_pred_norm"} <= set(r["items"][0])
    assert "same prediction on 100.00% of items" in capsys.readouterr().out
    text = tmp_path / "t.txt"
    text.write_text(_text(20000))
    assert main(["eval", "--task", "perplexity", "--data", str(text), "--ctx", "64",
                 "--limit", "2", "--json", str(out)]) == 0  # fmt: skip
    m = json.loads(out.read_text())["metrics"]
    assert set(m) == {"ppl", "ppl_stderr", "tokens_scored"} and m["tokens_scored"] == 2 * 31
    assert f"over {2 * 31} tokens (2 windows)" in capsys.readouterr().out
    assert main(["eval", "--task", "perplexity", "--data", str(text), "--ctx", "64",
                 "--limit", "1"]) == 0  # fmt: skip
    assert "over 31 tokens (1 window)\n" in capsys.readouterr().out


def test_input_formats_read_the_same(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    recs = _records("sciq_validation.jsonl.xz", 5)
    paths = [_jsonl(tmp_path / "a.jsonl", recs)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    paths.append(tmp_path / "a.jsonl.gz")
    table = pa.Table.from_pylist(recs)
    pq.write_table(table, tmp_path / "a.parquet")
    paths.append(tmp_path / "a.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "disk"))
    paths.append(tmp_path / "disk")
    for p in paths:
        assert read_records(p) == recs, p


def _error(capsys, *argv: str) -> str:
    assert main(["eval", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_bad_inputs(tmp_path, capsys, tiny):
    _family, _model, _hf, store = tiny
    missing = tmp_path / "nope.jsonl"
    assert str(missing) in _error(capsys, "--task", "sciq", "--data", str(missing))
    bad = _jsonl(tmp_path / "bad.jsonl", [{"question": "q?", "support": ""}])
    err = _error(capsys, "--task", "sciq", "--data", str(bad))
    assert "bad.jsonl:item 0" in err and "'distractor1'" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert f"{empty}: empty text" in _error(capsys, "--task", "perplexity", "--data", str(empty))
    text = tmp_path / "t.txt"
    text.write_text(_text(3000))
    err = _error(capsys, "--task", "perplexity", "--data", str(text), "--ctx", "100000")
    assert "--ctx 100000" in err and "context length" in err
    err = _error(capsys, str(store), "--task", "perplexity", "--data", str(text), "--ctx", "16",
                 "--reference", str(Path(__file__).parents[1] / "colibri/data/demo"))  # fmt: skip
    assert "--reference" in err and "another model" in err
    # refused before any weights load, naming the option and the path
    err = _error(capsys, "--task", "perplexity", "--data", str(text), "--reference",
                 str(tmp_path / "no-store"))  # fmt: skip
    assert err.startswith("colibri: error: --reference: ") and "no-store" in err, err
    err = _error(capsys, "--task", "perplexity", "--data", str(text), "--reference", str(text))
    assert "--reference: " in err and "t.txt" in err, err
    err = _error(capsys, "--task", "perplexity", "--data", str(text), "--ctx", "3")
    assert "--ctx 3: a perplexity window needs at least 4 tokens" in err, err
    # the same sizes, another tokenizer: refused (its ids are another vocabulary's)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(store, other)
    swap = DEMO / "tokenizer.json" if "olmoe" in _family else _need(OLMOE_TOKENIZER)
    (other / "tokenizer.json").write_bytes(swap.read_bytes())
    err = _error(capsys, str(store), "--task", "perplexity", "--data", str(text), "--ctx", "16",
                 "--reference", str(other))  # fmt: skip
    assert f"--reference {other}: another tokenizer" in err, err
    short = tmp_path / "short.txt"
    short.write_text("a few words")
    err = _error(capsys, "--task", "perplexity", "--data", str(short))
    assert f"--data {short}: the text has" in err and "fewer than one window" in err
    out = tmp_path / "no-such-folder" / "out.json"  # refused before any window is scored
    err = _error(capsys, "--task", "perplexity", "--data", str(text), "--json", str(out))
    assert f"--json {out}" in err and "not a writable folder" in err
    err = _error(capsys, "--task", "perplexity", "--data", str(text), "--json", str(tmp_path))
    assert f"--json {tmp_path}: is a directory" in err  # before the eval, not after it
    notjson = tmp_path / "x.jsonl"
    notjson.write_text('{"a": 1}\nnot json\n')
    assert "x.jsonl:2: not JSON" in _error(capsys, "--task", "boolq", "--data", str(notjson))
    with pytest.raises(EvalError, match="--shots"):
        build_requests("hellaswag", _docs("hellaswag", 1), "x", shots=2)


@needs_lm_eval
def test_encode_pair_equals_lm_eval(tiny, hflm):
    """Trailing spaces of the context move to the continuation, the whole is tokenized once
    (lm_eval TemplateLM._encode_pair through HFLM.tok_encode)."""
    _family, _model, hf, _store = tiny
    from colibri.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(hf)
    pairs = [("Question: why?\nAnswer: ", "because"), ("The cat  ", " sat"),
             ("Roof shingle removal: A man", " is on a roof."), ("x", "y z")]  # fmt: skip
    contexts: dict[str, list[int]] = {}  # eval's per-item cache of context tokens
    for ctx, cont in [*pairs, (pairs[1][0], " ran"), (pairs[1][0], " sat")]:
        want = tuple(hflm._encode_pair(ctx, cont))
        assert scoring.encode_pair(tok, ctx, cont) == want
        assert scoring.encode_pair(tok, ctx, cont, contexts) == want
    assert len(contexts) == len(pairs)  # one tokenization per distinct context
    # an empty context: lm-eval's loglikelihood puts prefix_token_id (BOS, else EOS) first
    ctx_enc, cont_enc = scoring.encode_pair(tok, "", "hello there")
    assert ctx_enc == [hflm.prefix_token_id]
    assert cont_enc == tok.encode("hello there", add_special_tokens=False)
