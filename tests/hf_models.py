"""Tiny random Hugging Face MoE models, built with transformers in the test itself.

The default init hides bugs (norms all 1, biases 0, router gaps ~1e-4), so norms and biases
are perturbed and `initializer_range` raised. `router_gap()` tells how close a run came to a
routing tie, so tests can skip prompts whose expert choice is numerically ambiguous.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from colibri import registry

torch = __import__("pytest").importorskip("torch")
transformers = __import__("pytest").importorskip("transformers")

torch.set_num_threads(1)

COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    tie_word_embeddings=False,
)

# Every family's tiny test cases (Family.test_configs, colibri/models/<model_type>.py):
# case name -> (model_type, config overrides on top of COMMON)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    case: (model_type, cfg)
    for model_type, fam in registry.FAMILIES.items()
    for case, cfg in fam.test_configs.items()
}
# the families with a base case named after them: all but the multimodal wrappers (llama4), whose
# tests build the wrapper checkpoint around their text family's case (test_families_14b.py)
BASE_CASES: tuple[str, ...] = tuple(t for t in registry.SUPPORTED if t in CASES)


def config(case: str, **overrides: Any) -> Any:
    """The transformers config of test case `case` (COMMON + its overrides + `overrides`)."""
    model_type, extra = CASES[case]
    kw = {**COMMON, **extra, **overrides}
    n, types = kw.get("num_hidden_layers"), kw.get("layer_types")
    if types is not None and len(types) != n:  # the depth was overridden: repeat the pattern
        kw["layer_types"] = [types[i % len(types)] for i in range(n)]
    if types is not None and kw.get("num_kv_shared_layers"):  # Gemma 4, at any depth: each
        # layer type keeps a layer with its own keys and values before the shared ones
        kw["num_kv_shared_layers"] = min(kw["num_kv_shared_layers"], n - len(set(types)))
    if "vision_config" in kw:
        # multimodal: the language model under text_config, the case's tiny vision tower
        vision = kw.pop("vision_config")
        outer = kw.pop("outer_config", {})  # top-level fields of the multimodal config
        return transformers.AutoConfig.for_model(
            model_type,
            text_config=kw,
            vision_config=vision,
            tie_word_embeddings=kw.get("tie_word_embeddings"),
            **outer,
        )
    # a family transformers builds as another type (kimi_k2: deepseek_v3); save() re-lays it
    hf_type = registry.family(model_type).text_model_type or model_type
    return transformers.AutoConfig.for_model(hf_type, **kw)


def auto_class(case: str) -> Any:
    """The transformers Auto class that builds test case `case`: the image-text-to-text
    model for multimodal families (its checkpoint has the vision tower), else causal LM."""
    if "vision_config" in CASES[case][1]:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def build(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random *ForCausalLM of test case `model_type` (a CASES name; config
    `overrides` on top) in f32 eval mode, norms (around their init) and biases perturbed;
    DeepSeek/GLM `e_score_correction_bias` (0 by default) and gpt-oss attention sinks are
    randomised too, Gemma 4's router scales and layer scalars (1 by default) perturbed."""
    torch.manual_seed(seed)
    model = auto_class(model_type).from_config(config(model_type, **overrides)).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                # around the init: 1, or 0 for zero-centred (1 + w) norms (Qwen3-Next)
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("_hc.base", "hc_head.hc_base")):  # DeepSeek-V4 (init 0)
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):  # (init 1)
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.per_expert_scale"):  # Gemma 4, init 1
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.scale"):  # Gemma 4, init 1; times sqrt(hidden_size)
                # to undo the router's 1/sqrt(d): else the tiny random router ties all the time
                d = p.shape[0]
                p.copy_((p + 0.3 * torch.randn(p.shape, generator=gen)) * d**0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # sigmoid scores are in (0, 1)
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):  # DeepSeek-V4 hash routing (init 0): k distinct
                n_exp = model.config.get_text_config().n_routed_experts
                rows = [torch.randperm(n_exp, generator=gen)[: b.shape[1]] for _ in range(len(b))]
                b.copy_(torch.stack(rows))
            elif name.endswith("layer_scalar"):  # Gemma 4, init 1
                b.copy_(b + 0.3 * torch.randn(b.shape, generator=gen))
    model.colibri_family = CASES[model_type][0]  # save() writes that family's layout
    # generate() masks prompt tokens equal to the pad id out of attention; the tests' random
    # prompts have no padding (Gemma 4's multimodal model needs a pad id for its own use)
    model.generation_config.pad_token_id = None
    return model


def save(model: Any, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    family_layout(model, path)
    return path


def family_layout(model: Any, path: Path) -> None:
    """A checkpoint saved by the transformers class of another model_type (the family's
    text_model_type, e.g. Kimi K2's DeepseekV3ForCausalLM; `model.colibri_family` set by
    build()) rewritten as the family's hub checkpoint: config.json's model_type is the
    family's; a multimodal family's (text_prefixes) config becomes its text_config, the
    language model's tensors (every shard, and the index) take the first source prefix that
    maps onto them, and a vision-tower tensor is added (the converter must drop it)."""
    import json

    from safetensors.torch import load_file, save_file

    family = getattr(model, "colibri_family", None)
    if family is None or family == model.config.model_type:
        return
    fam = registry.family(family)
    cfg = json.loads((path / "config.json").read_text())
    if not fam.text_prefixes:
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": fam.model_type}))
        return

    def hub(name: str) -> str:
        src, dst = next((s, d) for s, d in fam.text_prefixes if name.startswith(d))
        return src + name[len(dst) :]

    shards = sorted(path.glob("*.safetensors"))
    for i, shard in enumerate(shards):
        tensors = {hub(name): t for name, t in load_file(shard).items()}
        if i == 0:
            tensors["vision_tower.patch_embed.proj.weight"] = torch.ones((8, 3))
        save_file(tensors, shard, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {hub(k): v for k, v in idx["weight_map"].items()}
        idx["weight_map"]["vision_tower.patch_embed.proj.weight"] = shards[0].name
        index.write_text(json.dumps(idx))
    outer = {
        "model_type": fam.model_type,
        "text_config": cfg,
        "vision_config": {"hidden_size": 8},
        "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
    }
    (path / "config.json").write_text(json.dumps(outer))


def router_gap(model: Any, ids: list[int]) -> float:
    """Smallest gap, over layers and tokens, between the k-th and (k+1)-th router probability
    (and between the two largest logits of the output), on the sequence `ids`."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    cfg = model.config
    k = cfg.num_experts_per_tok
    gap = float("inf")
    for logits in out.router_logits or ():
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1).values
        gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
    top2 = torch.topk(out.logits[0].float(), 2, dim=-1).values
    return min(gap, float((top2[:, 0] - top2[:, 1]).min()))


def reference_logits(model: Any, ids: list[int]) -> np.ndarray:
    """f32 [len(ids), vocab] logits of the full sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[0, len(ids) :].tolist()


def router_margins(mod: Any, logits: Any, bias: Any = None) -> Any:
    """Per token, the smallest margin at the cuts the router `mod` makes (groups kept, experts
    chosen), recomputed from its logits as the transformers router does (DeepSeek-V2/V3,
    GLM-4.5, gpt-oss; MiniMax-M2, whose correction bias is a forward argument `bias`; Gemma 4,
    whose router returns the probabilities it chooses on). Returns a float tensor [n_tokens]."""
    logits = logits.float()
    k = mod.top_k if hasattr(mod, "top_k") else mod.config.top_k_experts  # Gemma4TextRouter
    if bias is None:
        bias = getattr(mod, "e_score_correction_bias", None)
    if "GptOss" in type(mod).__name__ or "Llama4" in type(mod).__name__:
        choice = logits  # top-k on the (biased) logits
    elif "DeepseekV4" in type(mod).__name__:  # its scoring_func, then the bias
        choice = mod.score_fn(logits) + bias
    elif type(mod).__name__ == "Gemma4TextRouter":
        choice = logits  # already the softmax probabilities
    elif bias is not None:
        choice = logits.sigmoid() + bias
    else:
        choice = logits.softmax(dim=-1)
    margin = torch.full((len(choice),), float("inf"))
    grouped = bias is not None or getattr(mod, "topk_method", "") == "group_limited_greedy"
    if grouped and getattr(mod, "topk_group", 1) < getattr(mod, "num_group", 1):
        g = choice.view(len(choice), mod.num_group, -1)
        gs = g.topk(2, dim=-1)[0].sum(-1) if bias is not None else g.max(-1).values
        top = gs.topk(mod.topk_group + 1, dim=-1).values
        margin = torch.minimum(margin, top[:, -2] - top[:, -1])
        keep = gs.topk(mod.topk_group, dim=-1).indices
        mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(g.shape[-1], dim=1), float("-inf"))
    top = choice.topk(k + 1, dim=-1).values
    return torch.minimum(margin, (top[:, k - 1] - top[:, k]).nan_to_num(float("inf")))


def assert_routes_match(
    ids: Any, weights: Any, ours_ids: np.ndarray, ours_w: np.ndarray, margins: Any
) -> None:
    """colibri's experts (ours_ids, ours_w: [n_tokens, k]) are transformers' (ids, weights
    tensors), each weight within 1e-6 (relative above 1), for every token whose router_margins
    are >= 1e-5 (closer cuts are the order of f32 rounding); at least 400 tokens compared."""
    compared = 0
    for t in np.flatnonzero(np.asarray(margins) >= 1e-5):
        ref = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        got = dict(zip(ours_ids[t].tolist(), ours_w[t].tolist(), strict=True))
        assert set(got) == set(ref), (t, got, ref)
        for e, wt in ref.items():
            assert abs(got[e] - wt) <= 1e-6 * max(1.0, abs(wt)), (t, e, got[e], wt)
        compared += 1
    assert compared >= 400


def choice_gap(model: Any, ids: list[int]) -> float:
    """Like router_gap(), for every router family: the smallest margin, over layers and tokens,
    at each cut the router makes (score used for choosing, correction bias and group limits
    included), and between the two largest output logits, on the sequence `ids`."""
    gaps: list[float] = []
    routers = [
        m
        for m in model.modules()
        if type(m).__name__.lower().endswith("topkrouter")
        or type(m).__name__ in ("Llama4Router", "Gemma4TextRouter")
    ]

    def hook(mod: Any, args: Any, out: Any) -> None:
        logits = out[1] if type(mod).__name__ == "Llama4Router" else out[0]  # (scores, logits)
        bias = args[1] if len(args) > 1 else None  # MiniMax-M2: e_score_correction_bias
        gaps.append(float(router_margins(mod, logits, bias).min()))

    hooks = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    top2 = torch.topk(logits, 2, dim=-1).values
    return min([*gaps, float((top2[:, 0] - top2[:, 1]).min())])


# ../shared/data beside the checkout; COLIBRI_SHARED_DATA overrides (a git worktree elsewhere)
SHARED = Path(
    os.environ.get("COLIBRI_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
)
OLMOE_TOKENIZER = SHARED / "tokenizers" / "olmoe" / "allenai_gpt-neox-olmo-dolma-v1_5.json"


def save_with_tokenizer(model_type: str, path: Path, seed: int = 0) -> Any:
    """A tiny model whose vocabulary is the real OLMoE tokenizer's (50304 ids), saved to path
    with tokenizer.json, tokenizer_config.json (ChatML-style template) and
    generation_config.json. Returns the transformers model."""
    import pytest

    if not OLMOE_TOKENIZER.exists():
        pytest.skip(f"shared data missing: {OLMOE_TOKENIZER}")
    torch.manual_seed(seed)
    vocab = dict(vocab_size=50304)
    if "vocab_size_per_layer_input" in CASES[model_type][1]:  # Gemma 4's per-layer table
        vocab["vocab_size_per_layer_input"] = 50304
    cfg = config(model_type, **vocab)
    model = auto_class(model_type).from_config(cfg).float().eval()
    model.colibri_family = CASES[model_type][0]
    save(model, path)
    (path / "tokenizer.json").write_bytes(OLMOE_TOKENIZER.read_bytes())
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    import json

    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": template})
    )
    return model


def find_prompt(model: Any, seed: int, prompt_len: int, new_tokens: int, min_gap: float) -> Any:
    """A random prompt of prompt_len ids whose run (prompt + new_tokens greedy tokens) has no
    routing cut or argmax gap below min_gap (8 tries), else None."""
    rng = np.random.default_rng(seed)
    for _ in range(8):
        ids = rng.integers(0, model.config.get_text_config().vocab_size, prompt_len).tolist()
        if choice_gap(model, ids + greedy(model, ids, new_tokens)) > min_gap:
            return ids
    return None


async def engine_greedy(store: Path, ids: list[int], n: int, **options: Any) -> Any:
    """colibri's n greedy tokens after ids, and the logits before each, f32 [n, vocab]."""
    from colibri.engine import open_engine

    async with open_engine(store, **options) as engine:
        seq = engine.new_sequence()
        logits = await engine.forward(seq, ids)
        out, all_logits = [], []
        for _ in range(n):
            all_logits.append(logits)
            out.append(int(np.argmax(logits)))
            logits = await engine.forward(seq, [out[-1]])
    return out, np.stack(all_logits)


async def assert_same_tokens_whatever_the_placement(case: str, tmp_path: Path) -> None:
    """Tiny `case` converted to Q4_0: reader backends (uring, threads, mmap) x budgets (one
    layer's top-k, everything) x prefetch on/off give the same greedy tokens as the threads
    reader holding everything; the small budget really evicts and re-reads."""
    import itertools

    from colibri.convert import convert
    from colibri.io.format import open_store

    src = save(build(case, seed=7), tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant="q4_0", dense_quant="q8_0")
    s = open_store(store)
    record, k = s.layout.record_nbytes, s.config["num_experts_per_tok"]
    total = len(s.records) * record
    ids = list(range(3, 19))
    reference, _ = await engine_greedy(store, ids, 12, io="threads", budget=total, prefetch=False)
    for io, budget, prefetch in itertools.product(
        ("uring", "threads", "mmap"), (k * record, total), (False, True)
    ):
        tokens, _ = await engine_greedy(
            store, ids, 12, io=io, budget=budget, prefetch=prefetch, threads=1
        )
        assert tokens == reference, (case, io, budget, prefetch)
