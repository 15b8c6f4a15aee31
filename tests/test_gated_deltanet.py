"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the recurrent kernel's scalar / AVX2 / AVX-512 bodies
against a float64 oracle and transformers' torch_recurrent_gated_delta_rule; the chunked form
against the recurrent one directly and against torch_chunk_gated_delta_rule; the conv with its
state; and in the engine, the conv and recurrent states carried across prefill chunks and into
decode, kept per sequence in the KV cache, and independent of placement."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from colibri.compute import deltanet, ops, ref
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import ColibriError, KernelError
from colibri.eval import continuation_logprobs
from colibri.model import GDR_CHUNK
from tests import hf_models

torch = hf_models.torch
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

ISAS = [i for i in (ops.ISA.SCALAR, ops.ISA.AVX2, ops.ISA.AVX512) if i <= ops.best_isa()]


@pytest.fixture
def isa():
    before = ops.isa()
    yield
    ops.set_isa(before)


def _inputs(rng, n, hk, hv, dk, dv):
    """Raw (q, k, v, g, beta, state) as the layer feeds them before l2norm."""
    f = np.float32
    q = rng.standard_normal((n, hk, dk)).astype(f)
    k = rng.standard_normal((n, hk, dk)).astype(f)
    v = rng.standard_normal((n, hv, dv)).astype(f)
    g = (-2.0 * rng.random((n, hv))).astype(f)
    beta = rng.random((n, hv)).astype(f)
    state = (0.2 * rng.standard_normal((hv, dk, dv))).astype(f)
    return q, k, v, g, beta, state


def _normed(q, k):
    dk = q.shape[-1]
    return deltanet.l2norm(q) * np.float32(dk**-0.5), deltanet.l2norm(k)


def _torch(fn, q, k, v, g, beta, state, **kw):
    t = [torch.from_numpy(np.ascontiguousarray(x))[None] for x in (q, k, v, g, beta, state)]
    out, s = fn(
        *t[:5], initial_state=t[5], output_final_state=True, use_qk_l2norm_in_kernel=True, **kw
    )
    return out[0].numpy(), s[0].numpy()


@pytest.mark.parametrize("shape", [(7, 2, 4, 16, 24), (3, 1, 1, 32, 128), (5, 2, 2, 8, 17)])
def test_recurrent_kernel_every_isa(isa, shape):
    """Each ISA's body against the float64 oracle and transformers' recurrent rule; output and
    final state, GQA key heads, dv with a SIMD tail; thread count does not change a bit."""
    rng = np.random.default_rng(sum(shape))
    q, k, v, g, beta, s0 = _inputs(rng, *shape)
    qn, kn = _normed(q, k)
    want, want_s = ref.gated_delta_rule(qn, kn, v, g, beta, s0)
    hf, _ = _torch(qwen3_next.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    np.testing.assert_allclose(hf, want, atol=2e-6, rtol=1e-5)
    results = []
    for level in ISAS:
        ops.set_isa(level)
        for threads in (1, 2):
            s = s0.copy()
            out = np.empty_like(v)
            ops.gated_delta_rule(out, s, qn, kn, v, g, beta, nthreads=threads)
            np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5, err_msg=level.name)
            np.testing.assert_allclose(s, want_s, atol=2e-6, rtol=1e-5, err_msg=level.name)
            np.testing.assert_allclose(out, hf, atol=2e-6, rtol=1e-5)
            results.append((level, threads, out, s))
    for level, _, out, s in results:  # per ISA, threads are bit-identical
        same = [r for r in results if r[0] == level]
        assert all(np.array_equal(out, r[2]) and np.array_equal(s, r[3]) for r in same)


def test_recurrent_kernel_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, s = _inputs(rng, 4, 2, 4, 8, 8)
    out = np.empty_like(v)
    with pytest.raises(KernelError, match="state has shape"):
        ops.gated_delta_rule(out, s[:2], q, k, v, g, beta)
    with pytest.raises(KernelError, match="multiple of 3 key heads"):
        q3, k3 = (np.ascontiguousarray(np.repeat(x, 3, axis=1)[:, :3]) for x in (q, k))
        ops.gated_delta_rule(out, s, q3, k3, v, g, beta)
    with pytest.raises(KernelError, match=r"g .* and beta"):
        ops.gated_delta_rule(out, s, q, k, v, g[:2], beta)


@pytest.mark.parametrize(("n", "chunk"), [(1, 64), (63, 64), (64, 64), (150, 64), (37, 16)])
def test_chunked_form_agrees_with_recurrent(n, chunk):
    """The chunked form and the recurrent kernel directly (output and state), and each
    against transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule."""
    rng = np.random.default_rng(n)
    q, k, v, g, beta, s0 = _inputs(rng, n, 2, 4, 16, 24)
    qn, kn = _normed(q, k)
    s_rec, rec = s0.copy(), np.empty_like(v)
    ops.gated_delta_rule(rec, s_rec, qn, kn, v, g, beta)
    s_chunk = s0.copy()
    chunked = deltanet.chunk_gated_delta_rule(qn, kn, v, g, beta, s_chunk, chunk)
    np.testing.assert_allclose(chunked, rec, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_chunk, s_rec, atol=2e-5, rtol=1e-4)
    hf, hf_s = _torch(
        qwen3_next.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0, chunk_size=chunk
    )
    np.testing.assert_allclose(chunked, hf, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s_chunk, hf_s, atol=2e-5, rtol=1e-4)
    hf_r, _ = _torch(qwen3_next.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    np.testing.assert_allclose(rec, hf_r, atol=2e-6, rtol=1e-5)


def test_state_carries_across_calls():
    """Feeding a sequence in pieces (chunked, recurrent, mixed) equals feeding it at once."""
    rng = np.random.default_rng(9)
    q, k, v, g, beta, s0 = _inputs(rng, 200, 2, 4, 16, 24)
    qn, kn = _normed(q, k)
    whole, s_whole = ref.gated_delta_rule(qn, kn, v, g, beta, s0)
    s = s0.copy()
    parts = []
    for a, b in ((0, 70), (70, 71), (71, 140), (140, 200)):
        if b - a >= 64:
            parts.append(
                deltanet.chunk_gated_delta_rule(qn[a:b], kn[a:b], v[a:b], g[a:b], beta[a:b], s)
            )
        else:
            out = np.empty_like(v[a:b])
            ops.gated_delta_rule(
                out,
                s,
                qn[a:b].copy(),
                kn[a:b].copy(),
                v[a:b].copy(),
                g[a:b].copy(),
                beta[a:b].copy(),
            )
            parts.append(out)
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, s_whole, atol=2e-5, rtol=1e-4)


def test_causal_conv1d_with_state():
    """Depthwise causal conv + SiLU as transformers' causal_conv1d_fn, whole or in pieces
    (the state holds the last kernel - 1 inputs)."""
    rng = np.random.default_rng(1)
    n, c, kernel = 40, 12, 4
    x = rng.standard_normal((n, c)).astype(np.float32)
    w = rng.standard_normal((c, kernel)).astype(np.float32)
    want = (
        qwen3_next.causal_conv1d_fn(
            torch.from_numpy(x.T.copy())[None], torch.from_numpy(w), None, activation="silu"
        )[0]
        .numpy()
        .T
    )
    state = np.zeros((kernel - 1, c), np.float32)
    got = np.concatenate(
        [deltanet.causal_conv1d(x[a:b], state, w) for a, b in ((0, 17), (17, 18), (18, 40))]
    )
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    np.testing.assert_array_equal(state, x[-(kernel - 1) :])


# ---- in the engine ---------------------------------------------------------------------------

CASES = [c for c, (mt, _) in hf_models.CASES.items() if mt in ("qwen3_next", "qwen3_5_moe")]
PROMPT_LEN, NEW_TOKENS = 150, 8


@pytest.fixture(scope="module", params=CASES)
def hybrid(request, tmp_path_factory):
    """(case, transformers model, f32 store, q4_0 store, prompt)."""
    case = request.param
    model = hf_models.build(case, seed=7)
    root = tmp_path_factory.mktemp(case)
    src = hf_models.save(model, root / "hf")
    f32 = convert(src, root / "f32", quant="f32", dense_quant="f32")
    q4 = convert(src, root / "q4", quant="q4_0", dense_quant="q8_0")
    ids = np.random.default_rng(3).integers(
        0, model.config.get_text_config().vocab_size, PROMPT_LEN
    )
    return case, model, f32, q4, ids.tolist()


async def _run(store, ids, n, prefill_chunk, chunked=False, **options):
    """Greedy tokens and the logits before each, prefilling in chunks of prefill_chunk (with
    the chunked form of the delta rule for chunks of >= GDR_CHUNK tokens if `chunked`)."""
    async with open_engine(store, **options) as engine:
        engine.model.gdr_chunked = chunked
        seq = engine.new_sequence()
        for a in range(0, len(ids), prefill_chunk):
            logits = await engine.forward(seq, ids[a : a + prefill_chunk])
        out, all_logits = [], []
        for _ in range(n):
            all_logits.append(logits)
            out.append(int(np.argmax(logits)))
            logits = await engine.forward(seq, [out[-1]])
        assert seq.kv.recurrent and any(s is not None and s.any() for s in seq.kv.recurrent)
    return out, np.stack(all_logits)


async def test_state_carries_across_prefill_chunks_and_into_decode(hybrid):
    """A 150-token prompt prefilled in chunks of 70, 40 and 256 (one go), with the recurrent
    kernel and with the chunked form (70, 256 >= GDR_CHUNK), then decoded: logits within 1e-4
    of transformers on the whole sequence at every step, and the same greedy tokens."""
    case, model, f32, _q4, ids = hybrid
    assert 40 < GDR_CHUNK <= 70
    expected = hf_models.greedy(model, ids, NEW_TOKENS)
    ref_logits = hf_models.reference_logits(model, ids + expected)[PROMPT_LEN - 1 : -1]
    scale = np.abs(ref_logits).max()
    for chunk, chunked in itertools.product((70, 40, 256), (False, True)):
        tokens, logits = await _run(f32, ids, NEW_TOKENS, chunk, chunked)
        assert tokens == expected, (case, chunk, chunked)
        err = np.abs(logits - ref_logits).max()
        assert err <= 1e-4 * scale, (case, chunk, chunked, err, scale)


async def test_state_is_per_sequence(hybrid):
    """Two sequences advanced in turns in one engine give what each gives alone: the conv
    and recurrent states live in each sequence's KV cache."""
    _case, _model, f32, _q4, ids = hybrid
    a, b = ids[:60], ids[60:130]
    alone = [await _run(f32, p, 4, 256) for p in (a, b)]
    async with open_engine(f32) as engine:
        seqs = [engine.new_sequence(), engine.new_sequence()]
        logits = [await engine.forward(s, p) for s, p in zip(seqs, (a, b), strict=True)]
        got: list[list] = [[], []]
        for _ in range(4):
            for j in (0, 1):
                got[j].append(logits[j])
                logits[j] = await engine.forward(seqs[j], [int(np.argmax(logits[j]))])
    for j in (0, 1):
        np.testing.assert_array_equal(np.stack(got[j]), alone[j][1])


async def test_placement_does_not_change_results(hybrid):
    """q4_0 store: byte-identical logits across reader backends, budgets, prefetch on/off and
    kernel thread counts."""
    from colibri.io.format import open_store

    _case, _model, _f32, q4, ids = hybrid
    s = open_store(q4)
    record, k = (
        s.layout.record_nbytes,
        s.config.get("num_experts_per_tok") or s.config["text_config"]["num_experts_per_tok"],
    )
    budgets = (k * record, len(s.records) * record)
    base = await _run(
        q4, ids[:80], 6, 70, io="threads", budget=budgets[1], prefetch=False, threads=1
    )
    for io, budget, prefetch, threads in itertools.product(
        ("uring", "mmap"), budgets, (False, True), (1, 2)
    ):
        got = await _run(
            q4, ids[:80], 6, 70, io=io, budget=budget, prefetch=prefetch, threads=threads
        )
        assert got[0] == base[0], (io, budget, prefetch, threads)
        np.testing.assert_array_equal(got[1], base[1])


def test_qwen3_5_converter_keeps_the_language_model(tmp_path, capsys):
    """A Qwen3.5 checkpoint (vision tower, language model under model.language_model., MTP
    head) converts to its language model only, saying what it dropped."""
    from safetensors.numpy import load_file, save_file

    from colibri.io.format import open_store
    from colibri.models.spec import dense_tensors
    from colibri.registry import model_spec

    src = hf_models.save(hf_models.build("qwen3_5_moe", seed=1), tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    tensors["mtp.fc.weight"] = np.ones((4, 4), np.float32)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    store = open_store(convert(src, tmp_path / "store", quant="f32", dense_quant="f32"))
    err = capsys.readouterr().err
    assert "kept the language model only" in err
    assert "model.visual.* (" in err and "mtp.fc.* (1)" in err
    spec = model_spec(store.config)
    assert set(store.dense_names()) == set(dense_tensors(spec))
    assert all(layer.moe for layer in spec.layers)
    kinds = [layer.linear_attn is not None for layer in spec.layers]
    assert kinds == [t == "linear_attention" for t in store.config["text_config"]["layer_types"]]


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-397b-a17b"])
def test_real_shapes_are_the_checkpoints(name):
    """tools/synth_store.py's real Qwen3-Next-80B-A3B / Qwen3.5-397B-A17B configs: the spec's
    dense tensors are what transformers builds from them (language model part, hub names),
    the layer kinds follow layer_types (15 x [3 DeltaNet + 1 attention] for Qwen3.5), and
    the routed experts' count, top-k and size match."""
    import sys
    from pathlib import Path

    from colibri import registry
    from colibri.models.spec import dense_tensors

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from synth_store import MODELS

    cfg = MODELS[name]
    fam = registry.family(cfg["model_type"])
    hf = hf_models.transformers.AutoConfig.for_model(**cfg)
    text = hf.get_text_config()
    with torch.device("meta"):
        model = hf_models.transformers.AutoModelForCausalLM.from_config(text)
    want = {n: tuple(t.shape) for n, t in model.state_dict().items() if ".experts." not in n}
    spec = registry.model_spec(cfg)
    assert dense_tensors(spec) == want
    assert [la.linear_attn is not None for la in spec.layers] == [
        t == "linear_attention" for t in text.layer_types
    ]
    r = spec.moe.router
    assert (r.num_experts, r.top_k, spec.moe.d_ff) == (
        text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size,
    )  # fmt: skip
    if fam.text_model_type:
        assert sum(t == "full_attention" for t in text.layer_types) == 15
    a = next(la.attention for la in spec.layers if la.linear_attn is None)
    assert a.rot_dim == 64 and a.output_gate


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("interval", [2, 4])
def test_layer_kinds_from_full_attention_interval(model_type, interval):
    """Without layer_types, every full_attention_interval-th layer is full attention, as the
    transformers config computes it; a bad layer_types is refused naming the field."""
    from colibri import registry

    fam = registry.family(model_type)
    given = {"num_hidden_layers": 6, "full_attention_interval": interval}
    hf = hf_models.transformers.AutoConfig.for_model(fam.text_model_type or model_type, **given)
    spec = registry.model_spec({"model_type": model_type, **given})
    assert [la.linear_attn is None for la in spec.layers] == [
        t == "full_attention" for t in hf.layer_types
    ]
    from colibri.errors import StoreError

    with pytest.raises(StoreError, match="layer_types must list 2"):
        registry.model_spec(
            {"model_type": model_type, "num_hidden_layers": 2, "layer_types": ["x", "y"]}
        )


# ---- the per-sequence state under the engine's other users ----------------------------------


async def _stream(engine, ids, n=4):
    return [
        t.token_id
        async for t in engine.stream(ids, max_tokens=n, temperature=0)
        if t.token_id is not None
    ]


async def test_prefix_cache_and_batching_keep_the_state(hybrid):
    """With the prefix cache on, a prompt seen before and concurrent streams still give
    transformers' greedy tokens: a hybrid model's state is not per position, so the prefix
    cache reuses nothing for it, and batched sequences each keep their own state."""
    case, model, f32, _q4, ids = hybrid
    a, b = ids[:100], ids[:90] + ids[120:130]  # b shares a's first 90 tokens
    want = [hf_models.greedy(model, p, 4) for p in (a, b)]
    async with open_engine(f32, prefix_cache=8 << 20, max_running=4) as engine:
        assert [await _stream(engine, p) for p in (a, b, a)] == [*want, want[0]], case
        assert await asyncio.gather(*(_stream(engine, p) for p in (a, b))) == want, case
        assert engine.prefix_cache.hit_tokens == 0


async def test_eval_choices_restore_the_state(hybrid):
    """colibri eval feeds a shared context once and every choice continues from it: on a
    hybrid model each choice's log-probabilities equal transformers' on context + choice."""
    case, model, f32, _q4, ids = hybrid
    ctx, choices = ids[:40], [ids[40:47], ids[60:64], ids[80:89]]
    async with open_engine(f32) as engine:
        got = await continuation_logprobs(engine, ctx, choices)
    for c, lp in zip(choices, got, strict=True):
        logits = torch.log_softmax(torch.from_numpy(hf_models.reference_logits(model, ctx + c)), -1)
        want = logits[len(ctx) - 1 : -1].numpy()[np.arange(len(c)), c]
        np.testing.assert_allclose(lp, want, atol=1e-4, err_msg=case)


async def test_truncate_refuses_to_cut_the_state(hybrid):
    _case, _model, f32, _q4, ids = hybrid
    async with open_engine(f32) as engine:
        seq = engine.new_sequence()
        await engine.forward(seq, ids[:20])
        with pytest.raises(ColibriError, match="recurrent state cannot be cut back"):
            seq.truncate(10)
        seq.truncate(0)  # starting over is fine: the state is zeroed
        assert seq.length == 0 and not any(r.any() for r in seq.kv.recurrent if r is not None)


async def test_session_reopens_with_the_state(hybrid, tmp_path):
    """A hybrid model's session keeps the conv / recurrent state: a conversation reopened
    from its file answers the next turn exactly as the uninterrupted one and as a fresh
    prefill of the whole conversation."""
    case, _model, f32, _q4, ids = hybrid
    turn1 = ids[:50]

    async def answer(session, prompt):
        return [
            t.token_id
            async for t in session.stream(prompt, max_tokens=4, temperature=0)
            if t.token_id is not None
        ]

    async with open_engine(f32) as engine:
        s = engine.new_session()
        a1 = await answer(s, turn1)
        engine.save_session(tmp_path / "s.session", s)
        turn2 = turn1 + a1 + ids[50:60]
        uninterrupted = await answer(s, turn2)
        fresh = await _stream(engine, turn2)
    async with open_engine(f32) as engine:
        reopened = await answer(engine.load_session(tmp_path / "s.session"), turn2)
    assert reopened == uninterrupted == fresh, case
