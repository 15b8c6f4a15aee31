"""Gemma 4 with the MoE block (gemma4_text, and the multimodal gemma4 checkpoint) against
transformers 5.24 (issue 14).

The engine standard (f32 logits within 1e-4 and 32 greedy tokens, q8_0 / q4_0 KL bounds) runs
for the Gemma cases in test_engine_exact.py. Here: the router against Gemma4TextRouter; the
quantized stores against transformers running the very weights they hold (dequantized), at a
prompt longer than the sliding window, in prefill and token by token; what the spec reads from
hub-style config.json files (per-layer-type head dims and RoPE, KV sharing, the double-wide
MLP) against what transformers builds; refusals naming the field; the same tokens whatever
the placement; concurrent streams in the scheduler's batched forward equal to solo runs.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from colibri.compute import moe
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import StoreError
from colibri.io.format import open_store
from colibri.model import KVCache
from colibri.registry import model_spec
from tests import hf_models

torch, transformers = hf_models.torch, hf_models.transformers
gguf = pytest.importorskip("gguf")
_run = hf_models.engine_greedy
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64)


@pytest.mark.parametrize(("experts", "k"), [(8, 1), (16, 2), (128, 8)])
def test_route_matches_transformers_router(experts, k):
    """moe.route (softmax, top-k, renormalised, times per_expert_scale) on the logits of
    Gemma4TextRouter picks the experts transformers picks, with the same weights."""
    from transformers.models.gemma4 import modeling_gemma4 as mg

    config = transformers.Gemma4TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        **(MOE | dict(num_experts=experts, top_k_experts=k)),
    )
    router = mg.Gemma4TextRouter(config)
    gen = torch.Generator().manual_seed(experts + k)
    with torch.no_grad():
        router.proj.weight.copy_(0.5 * torch.randn(router.proj.weight.shape, generator=gen))
        router.scale.copy_(32**0.5 * (1 + 0.3 * torch.randn(32, generator=gen)))
        router.per_expert_scale.copy_(1 + 0.3 * torch.randn(experts, generator=gen))
        x = torch.randn(512, 32, generator=gen)
        probs, weights, ids = router(x)
        logits = router.proj(router.norm(x) * router.scale * router.scalar_root_size)
    spec = model_spec(config.to_dict()).moe.router
    assert (spec.scoring, spec.norm_topk_prob, spec.top_k) == ("softmax", True, k)
    ours_ids, ours_w = moe.route(
        spec, logits.numpy(), None, expert_scale=router.per_expert_scale.detach().numpy()
    )
    margins = hf_models.router_margins(router, probs).numpy()
    compared = 0
    for t in np.flatnonzero(margins >= 1e-5):
        ref = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        got = dict(zip(ours_ids[t].tolist(), ours_w[t].tolist(), strict=True))
        assert set(got) == set(ref), (t, got, ref)
        for e, wt in ref.items():
            assert abs(got[e] - wt) <= 1e-6 * max(1.0, abs(wt)), (t, e, got[e], wt)
        compared += 1
    assert compared >= 400


def _round_trip(model, quant: str) -> None:
    """The weights transformers runs replaced, in place, by what a store converted with
    quant / dense_quant q8_0 holds: experts in `quant`, every other 2-D weight whose rows are
    whole blocks in q8_0 (routers stay f32), quantized and dequantized by the gguf package."""

    def rt(w, qtype):
        a = w.detach().numpy().astype(np.float32)
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype))

    q8, qe = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType[quant.upper()]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(torch.stack([rt(e, qe).reshape(e.shape) for e in p]))
            elif p.ndim == 2 and "router" not in name and p.shape[-1] % 32 == 0:
                p.copy_(rt(p, q8).reshape(p.shape))


@pytest.mark.parametrize("case", ["gemma4_text", "gemma4_text_plain"])
@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
async def test_quantized_store_runs_what_transformers_runs_on_its_weights(case, quant, tmp_path):
    """A q8_0 / q4_0 store (f32 activations) gives the logits transformers gives with the
    store's own dequantized weights, within 1e-4 of their scale: the Gemma math holds under
    quantization, so the KL of test_engine_exact.py is the tiny model's sensitivity alone. The
    48-token prompt is six sliding windows long (sliding_window 8): in one prefill (every
    position's logits) and token by token."""
    model = hf_models.build(case, seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    store = tmp_path / quant
    convert(src, store, quant=quant, dense_quant="q8_0")
    _round_trip(model, quant)
    ids = np.random.default_rng(11).integers(0, 160, 48).tolist()
    ref = hf_models.reference_logits(model, ids)
    async with open_engine(store, activations="f32") as engine:
        seq = engine.new_sequence()
        prefill = await engine.forward(seq, ids, all_logits=True)
        seq = engine.new_sequence()
        decode = np.stack([await engine.forward(seq, [t]) for t in ids])
    scale = np.abs(ref).max()
    for got in (prefill, decode):
        assert np.abs(got - ref).max() <= 1e-4 * scale, (case, quant, np.abs(got - ref).max())


def _hf(**kw):
    return transformers.Gemma4TextConfig(**(MOE | kw))


HUB_VARIANTS = [
    {},  # the class defaults: 30 layers, 5 sliding to 1 full, global_head_dim 512, PLE 256
    dict(  # 26B-A4B-like: k_eq_v full layers with their own kv heads, no PLE, softcap
        num_hidden_layers=6,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        global_head_dim=512,
        num_global_key_value_heads=2,
        final_logit_softcapping=30.0,
        sliding_window=1024,
    ),
    dict(  # E2B-like sharing: the last layers reuse the caches, double-wide MLP there
        num_hidden_layers=12,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.5,
                "rope_theta": 2e6,
                "factor": 2.0,
            },
        },
    ),
]


@pytest.mark.parametrize("given", HUB_VARIANTS, ids=["defaults", "k_eq_v", "shared"])
def test_spec_resolves_what_transformers_resolves(given):
    """registry.model_spec of a hub-style config.json (global_head_dim, no per_layer_config)
    equals what transformers builds from it: per-layer head dims and kv heads, RoPE
    frequencies per layer type (Gemma4TextRotaryEmbedding), windows, which layers reuse
    which layer's cache, dense MLP widths, router, embedding scale, soft-cap, PLE."""
    from transformers.models.gemma4 import modeling_gemma4 as mg

    hf = _hf(**given)
    spec = model_spec({"model_type": "gemma4_text", **MOE, **given})
    assert len(spec.layers) == hf.num_hidden_layers
    assert spec.embed_scale == pytest.approx(hf.hidden_size**0.5)
    assert spec.final_logit_softcapping == hf.final_logit_softcapping
    ple = spec.per_layer_input
    assert (ple.hidden_size_per_layer_input if ple else 0) == hf.hidden_size_per_layer_input
    assert (spec.moe.router.top_k, spec.moe.router.num_experts) == (2, 8)
    rotary = mg.Gemma4TextRotaryEmbedding(hf)
    modes = hf.kv_sharing_modes
    with torch.device("meta"):
        layers = [mg.Gemma4TextDecoderLayer(hf, i) for i in range(hf.num_hidden_layers)]
    for i, (layer, t) in enumerate(zip(spec.layers, hf.layer_types, strict=True)):
        a, per = layer.attention, hf.per_layer_config[i]
        assert (a.head_dim, a.n_kv_heads) == (per.head_dim, per.num_key_value_heads), i
        assert (a.scale, a.qk_norm, a.v_norm) == (1.0, "head", True)
        np.testing.assert_allclose(a.inv_freq, getattr(rotary, f"{t}_inv_freq").numpy(), 1e-6)
        assert a.window == (hf.sliding_window if t == "sliding_attention" else 0), i
        assert a.k_eq_v == (hf.attention_k_eq_v and t == "full_attention"), i
        if modes[i] == "reuse":
            src = a.kv_shared_from
            assert src is not None and hf.layer_types[src] == t and modes[src] == "store", i
        else:
            assert a.kv_shared_from is None, i
        assert layer.mlp_d_ff == layers[i].mlp.intermediate_size, i
    # shared layers keep no keys of their own
    own = [la for la in spec.layers if la.attention.kv_shared_from is None]
    per_token = sum(2 * la.attention.n_kv_heads * la.attention.head_dim for la in own)
    assert KVCache.nbytes_for(spec, 16) == per_token * 16 * 4


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(enable_moe_block=False), "enable_moe_block"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(hidden_activation="gelu"), "hidden_activation"),
        (dict(layer_types=["chunked_attention"] * 30), "layer_types"),
        (dict(num_kv_shared_layers=30), "num_kv_shared_layers"),
        (dict(layer_types=["full_attention"] + ["sliding_attention"] * 29, num_kv_shared_layers=29),
         "num_kv_shared_layers"),  # no sliding layer before the shared ones
        (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters"),
        (dict(num_experts=None), "num_experts"),
        (dict(vocab_size_per_layer_input=1000), "vocab_size_per_layer_input"),
    ],
)  # fmt: skip
def test_unsupported_config_values_are_refused_naming_the_field(overrides, field):
    with pytest.raises(StoreError, match=field):
        model_spec({"model_type": "gemma4_text", **MOE, **overrides})


async def test_same_tokens_whatever_the_placement(tmp_path):
    """Reader backends x budgets (one layer's top-k, everything) x prefetch on/off give the
    same greedy tokens (prefetch routes the residual stream with the next layer's router)."""
    model = hf_models.build("gemma4_text", seed=7)
    src = hf_models.save(model, tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant="q4_0", dense_quant="q8_0")
    s = open_store(store)
    record, k = s.layout.record_nbytes, 2
    total = len(s.records) * record
    ids = list(range(3, 35))  # four sliding windows
    reference, _ = await _run(store, ids, 12, io="threads", budget=total, prefetch=False)
    for io, budget, prefetch in itertools.product(
        ("uring", "threads", "mmap"), (k * record, total), (False, True)
    ):
        tokens, _ = await _run(store, ids, 12, io=io, budget=budget, prefetch=prefetch, threads=1)
        assert tokens == reference, (io, budget, prefetch)


@pytest.mark.parametrize(("activations", "batch"), [("f32", "split"), ("q8_0", "fused")])
async def test_concurrent_streams_equal_solo_runs(activations, batch, tmp_path):
    """The scheduler's batched forward (Pipeline.forward_batch, split and fused) gives each
    Gemma 4 stream exactly its solo tokens and logprobs: the per-layer inputs, the dense MLP
    beside the experts and the shared KV caches stay per sequence."""
    model = hf_models.build("gemma4", seed=3)
    src = hf_models.save(model, tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant="q8_0", dense_quant="q8_0")
    rng = np.random.default_rng(2)
    reqs = [
        (rng.integers(0, 160, 5).tolist(), dict(max_tokens=16, temperature=0)),
        (rng.integers(0, 160, 40).tolist(), dict(max_tokens=16, temperature=0.9, seed=3)),
        (rng.integers(0, 160, 12).tolist(), dict(max_tokens=16, temperature=0, logprobs=2)),
    ]

    async def run(engine, prompt, kw):
        items = [t async for t in engine.stream(prompt, **kw)]
        return [(t.token_id, t.logprob) for t in items]

    opts = dict(io="threads", activations=activations, max_running=8, batch=batch)
    async with open_engine(store, **opts) as engine:
        s0 = engine.statistics()
        solo = [await run(engine, p, kw) for p, kw in reqs]
        s1 = engine.statistics()
        together = await asyncio.gather(*(run(engine, p, kw) for p, kw in reqs))
        shared = engine.statistics().delta(s1).forward_steps
    assert together == solo  # ids and logprobs, bit for bit
    assert shared < s1.delta(s0).forward_steps  # they really ran in shared steps
    # 16 tokens each (no EOS: the tiny config has none), then the closing item
    assert [sum(t is not None for t, _ in s) for s in solo] == [16, 16, 16]


RING_PROMPT, RING_NEW = 20, 32  # 52 positions: six and a half 8-token windows


@pytest.fixture(scope="module", params=["gemma4_text", "gemma4_text_plain"])
def ring_case(request, tmp_path_factory):
    """(case, transformers model, f32 store, prompt without near-ties) of a tiny Gemma 4 with
    sliding_window 8 ("gemma4_text": its last two layers share layers 0 (sliding) and 1)."""
    case = request.param
    model = hf_models.build(case, seed=3)
    root = tmp_path_factory.mktemp(case)
    store = root / "f32"
    convert(hf_models.save(model, root / "hf"), store, quant="f32", dense_quant="f32")
    ids = hf_models.find_prompt(model, 5, RING_PROMPT, RING_NEW, 1e-4)
    if ids is None:
        pytest.skip(f"{case}: no prompt without a near-tie in 8 tries")
    return case, model, store, ids


async def test_sliding_ring_matches_transformers_over_many_windows(ring_case):
    """Sliding layers keep a ring of sliding_window rows: a 20-token prompt prefilled in chunks
    of 3, 11 (more than a window: the ring wraps inside the chunk, and the layer sharing
    layer 0's cache reads the rows layer 0 saw) and 6, then 32 greedy tokens, 52 positions in
    all: every position's f32 logits within 1e-4 of transformers' scale, the same tokens."""
    case, model, store, ids = ring_case
    expected = hf_models.greedy(model, ids, RING_NEW)
    ref = hf_models.reference_logits(model, ids + expected)
    async with open_engine(store, activations="f32", n_ctx=256) as engine:
        seq = engine.new_sequence()
        a = engine.spec.layers[0].attention
        assert a.kv_ring and a.window == 8 and 0 in seq.kv.ring_layers
        assert seq.kv.k[0].shape[0] == seq.kv.v[0].shape[0] == 8
        got = []
        for lo, hi in ((0, 3), (3, 14), (14, 20)):
            got.extend(await engine.forward(seq, ids[lo:hi], all_logits=True))
        tokens = []
        while len(tokens) < RING_NEW:
            tokens.append(int(np.argmax(got[-1])))
            if len(tokens) < RING_NEW:
                got.append(await engine.forward(seq, [tokens[-1]]))
        assert seq.kv.window_rows == {}  # the shared rows are dropped after the last reader
    assert tokens == expected, case
    got = np.stack(got)
    err, scale = np.abs(got - ref[: len(got)]).max(), np.abs(ref).max()
    assert err <= 1e-4 * scale, (case, err, scale)


async def test_f16_ring_runs_what_transformers_runs_on_f16_keys(ring_case):
    """An f16 KV cache (kv_dtype "f16") keeps f16 rings: the 52 positions' logits (prefill in
    chunks of 3, 11 and 6, then one token at a time) stay within 1e-2 of transformers' scale,
    and within the f16 rounding of the f32 engine's (the rings hold what the cache holds)."""
    _case, model, store, ids = ring_case
    tail = hf_models.greedy(model, ids, RING_NEW)
    ref = hf_models.reference_logits(model, ids + tail)
    runs = []
    for kv in ("f32", "f16"):
        async with open_engine(store, activations="f32", n_ctx=256, kv_dtype=kv) as engine:
            seq = engine.new_sequence()
            assert seq.kv.k[0].dtype == np.dtype(np.float32 if kv == "f32" else np.float16)
            got = []
            for lo, hi in ((0, 3), (3, 14), (14, 20)):
                got.extend(await engine.forward(seq, ids[lo:hi], all_logits=True))
            for t in tail[:-1]:
                got.append(await engine.forward(seq, [t]))
            runs.append(np.stack(got))
    scale = np.abs(ref).max()
    assert np.abs(runs[1] - ref[:-1]).max() <= 1e-2 * scale
    assert 0 < np.abs(runs[1] - runs[0]).max() <= 1e-2 * scale  # f16 rounding, not f32's bits


async def test_snapshot_restore_and_fork_with_the_ring(ring_case):
    """With the rings wrapped past the snapshot point, restore() and fork() give exactly the
    logits of a fresh sequence fed the same tokens the same way: the ring rows are part of
    the sequence's state (a plain truncate back is refused, as on hybrid models)."""
    from colibri.errors import ColibriError

    _case, _model, store, ids = ring_case
    a_tail = np.random.default_rng(1).integers(0, 160, 12).tolist()
    b_tail = np.random.default_rng(2).integers(0, 160, 12).tolist()

    async def feed(engine, seq, tail):
        return np.stack([await engine.forward(seq, [t]) for t in tail])

    async with open_engine(store, activations="f32", n_ctx=128) as engine:
        fresh = {}
        for name, tail in (("a", a_tail), ("b", b_tail)):
            seq = engine.new_sequence()
            await engine.forward(seq, ids)
            fresh[name] = await feed(engine, seq, tail)
        seq = engine.new_sequence()
        await engine.forward(seq, ids)
        snap = seq.snapshot()
        other = seq.fork()
        got_a = await feed(engine, seq, a_tail)  # 12 tokens: every ring row overwritten
        with pytest.raises(ColibriError, match="snapshot"):
            seq.truncate(len(ids))
        seq.restore(snap)
        got_b = await feed(engine, seq, b_tail)
        fork_a = await feed(engine, other, a_tail)
    assert np.array_equal(got_a, fresh["a"]) and np.array_equal(fork_a, fresh["a"])
    assert np.array_equal(got_b, fresh["b"])


async def test_prefix_cache_and_sessions_with_the_ring(ring_case):
    """Serving with the prefix cache on gives the tokens of a run without it, for prompts
    sharing a prefix longer than the window (ring caches are not per position: they are not
    stored there, as hybrid models' states are not)."""
    _case, _model, store, ids = ring_case
    prompts = [[*ids, 7, 9], [*ids, 11], [*ids, 7, 9]]
    runs = []
    for prefix in (0, 1 << 20):
        async with open_engine(store, activations="f32", n_ctx=128, prefix_cache=prefix) as e:
            runs.append(
                [
                    [t.token_id async for t in e.stream(p, max_tokens=10, temperature=0)]
                    for p in prompts
                ]
            )
    assert runs[0] == runs[1]
    assert runs[0][0] == runs[0][2]


def test_sliding_kv_bytes_stop_growing_past_the_window():
    """A sliding layer's cache is min(n_ctx, sliding_window) rows, a full layer's n_ctx rows;
    nbytes_for says what allocate takes. At the real 26B-A4B shape (window 1024) a sliding
    layer holds 8 MiB in f16 whatever the context."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from synth_store import MODELS

    spec = model_spec(hf_models.config("gemma4_text").to_dict())
    own = [la for la in spec.layers if la.attention.kv_shared_from is None]
    slide = [la.index for la in own if la.attention.kv_ring]
    full = [la.index for la in own if not la.attention.kv_ring]
    assert slide and full
    for n_ctx in (4, 8, 9, 64, 4096):
        kv = KVCache.allocate(spec, n_ctx)
        assert kv.nbytes == KVCache.nbytes_for(spec, n_ctx)
        for i in slide:
            a = spec.layers[i].attention
            rows = min(n_ctx, a.window)
            assert kv.k[i].nbytes + kv.v[i].nbytes == rows * a.n_kv_heads * 2 * a.head_dim * 4
        for i in full:
            assert kv.k[i].shape[0] == n_ctx
        assert kv.ring_layers == (tuple(slide) if n_ctx > 8 else ())
    real = model_spec(MODELS["gemma-4-26b-a4b"])
    per = [KVCache.nbytes_for(real, n, np.float16) for n in (1024, 2048, 3072)]
    full_per_token = sum(
        2 * la.attention.n_kv_heads * la.attention.head_dim * 2
        for la in real.layers if not la.attention.kv_ring
    )  # fmt: skip
    assert per[1] - per[0] == per[2] - per[1] == 1024 * full_per_token  # only full layers grow
    ring = KVCache.nbytes_for(real, 1024, np.float16) - 1024 * full_per_token
    assert ring == 25 * 1024 * 8 * 256 * 2 * 2


def test_synthetic_preset_is_the_26b_a4b_shape():
    """tools/synth_store.py's gemma-4-26b-a4b: the spec's dense tensors are what transformers
    builds from its text_config (hub names), 25 sliding + 5 full layers, 128 experts of 704,
    top-8; 25.2B parameters in all and 3.8B active per token (Google's published figures)."""
    import sys
    from pathlib import Path

    from colibri.models.spec import dense_tensors

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from synth_store import MODELS

    cfg = MODELS["gemma-4-26b-a4b"]
    text = transformers.AutoConfig.for_model(**cfg).get_text_config()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text)
    want = {n: tuple(t.shape) for n, t in model.state_dict().items() if ".experts." not in n}
    assert text.tie_word_embeddings
    del want["lm_head.weight"]  # tied to the embedding: not stored
    spec = model_spec(cfg)
    assert dense_tensors(spec) == want
    assert [la.attention.kv_ring for la in spec.layers] == [
        t == "sliding_attention" for t in text.layer_types
    ]
    assert sum(la.attention.kv_ring for la in spec.layers) == 25
    r = spec.moe.router
    assert (r.num_experts, r.top_k, spec.moe.d_ff) == (128, 8, 704)
    expert = 3 * spec.moe.d_ff * spec.d_model
    dense = sum(np.prod(s) for s in want.values())
    total = dense + len(spec.layers) * r.num_experts * expert
    active = dense + len(spec.layers) * r.top_k * expert
    assert round(total / 1e9, 1) == 25.2 and round(active / 1e9, 1) == 3.8
