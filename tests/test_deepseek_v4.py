"""DeepSeek-V4 beyond the shared exactness test (tests/test_engine_exact.py): the
hyper-connection math against transformers' modules, prompts fed in uneven chunks (the
compressors' windows straddle forward calls) and snapshot / restore, the hash-routed layers'
experts told to the prefetcher exactly, fused batches, sessions, and the refusals."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from colibri.compute import dsv4
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import StoreError
from colibri.registry import model_spec
from tests import hf_models

torch = hf_models.torch
CASE = "deepseek_v4"


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(transformers model, f32 store, a 40-token prompt, its reference logits [40, vocab])."""
    model = hf_models.build(CASE, seed=7)
    root = tmp_path_factory.mktemp("dsv4")
    src = hf_models.save(model, root / "hf")
    store = root / "f32"
    convert(src, store, quant="f32", dense_quant="f32")
    ids = [int(t) for t in np.random.default_rng(11).integers(0, 160, 40)]
    return model, store, ids, hf_models.reference_logits(model, ids)


def test_hyper_connection_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperConnection,
        DeepseekV4HyperHead,
    )

    cfg = hf_models.config(CASE, hc_mult=3, hc_sinkhorn_iters=7)
    spec = model_spec(cfg.to_dict()).hc
    hc, head = DeepseekV4HyperConnection(cfg), DeepseekV4HyperHead(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (*hc.parameters(), *head.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        x = torch.randn((1, 5, 3, cfg.hidden_size), generator=gen)
        post, comb, collapsed = hc(x)
        final = head(x)
    xs = x[0].numpy()
    fn = hc.fn.detach().numpy()
    pre, p2, c2 = dsv4.hc_weights(
        xs, lambda t: t @ fn.T, hc.base.detach().numpy(), hc.scale.detach().numpy(), spec,
        cfg.rms_norm_eps,
    )  # fmt: skip
    np.testing.assert_allclose(p2, post[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c2, comb[0].numpy(), rtol=1e-5, atol=1e-6)
    # doubly stochastic up to the eps floors
    np.testing.assert_allclose(c2.sum(axis=-2), 1.0, atol=1e-4)
    np.testing.assert_allclose(dsv4.hc_collapse(xs, pre), collapsed[0].numpy(), atol=1e-5)
    hfn = head.hc_fn.detach().numpy()
    got = dsv4.hc_head(
        xs, lambda t: t @ hfn.T, head.hc_base.detach().numpy(), head.hc_scale.detach().numpy(),
        spec, cfg.rms_norm_eps,
    )  # fmt: skip
    np.testing.assert_allclose(got, final[0].numpy(), atol=1e-5)
    y = np.random.default_rng(1).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    streams = xs.copy()
    dsv4.hc_expand(streams, y, p2, c2)
    want = post[0, :, :, None] * torch.from_numpy(y)[:, None] + comb[0].transpose(-1, -2) @ x[0]
    np.testing.assert_allclose(streams, want.numpy(), atol=1e-5)


def test_chunked_prompt_snapshot_and_restore(v4):
    """A prompt fed in chunks of 3, 5, 1, 7, ... tokens (windows of the CSA (4) and HCA (8)
    compressors close inside and across calls) gives transformers' logits at each chunk's
    end; a snapshot restored after more tokens continues bit-identically."""
    _model, store, ids, ref = v4
    scale = np.abs(ref).max()

    async def run():
        async with open_engine(store, activations="f32") as eng:
            seq, pos, snap, after = eng.new_sequence(), 0, None, None
            for k, size in enumerate([3, 5, 1, 7, 2, 9, 4, 6, 3]):
                chunk = ids[pos : pos + size]
                logits = await eng.forward(seq, chunk)
                pos += len(chunk)
                err = np.abs(logits - ref[pos - 1]).max()
                assert err <= 1e-4 * scale, (pos, err)
                if k == 3:
                    snap = seq.snapshot()
                    after = await eng.forward(seq, ids[pos : pos + 6])
                    seq.restore(snap)
            assert pos == len(ids)
            seq.restore(snap)  # back to 16 tokens, the windows' rows as they were
            again = await eng.forward(seq, ids[16:22])
            np.testing.assert_array_equal(again, after)
            with pytest.raises(Exception, match="snapshot"):
                seq.truncate(10)

    asyncio.run(run())


def test_hash_layers_are_prefetched_exactly(v4):
    """Each forward tells the prefetcher every hash-routed layer's experts as soon as the
    tokens are known, and those are exactly the experts the layer then asks the cache for."""
    _model, store, ids, _ref = v4
    hash_layers = [s.index for s in model_spec(_config(store)).layers if s.hash_routed]
    assert hash_layers

    async def run():
        async with open_engine(store, activations="f32", budget=1 << 20) as eng:
            pipe = eng.pipeline
            predicted, requested = [], []
            predict, request = pipe.prefetcher.predict, pipe.cache.request

            def on_predict(layer, experts, **kw):
                if layer in hash_layers:
                    predicted.append((layer, sorted(experts)))
                return predict(layer, experts, **kw)

            def on_request(layer, experts):
                if layer in hash_layers:
                    requested.append((layer, sorted(experts)))
                return request(layer, experts)

            pipe.prefetcher.predict, pipe.cache.request = on_predict, on_request
            seq = eng.new_sequence()
            await eng.forward(seq, ids[:20])
            for t in ids[20:30]:
                n = len(requested)
                await eng.forward(seq, [t])
                if len(predicted) > n:  # the prefetcher was on for this token
                    assert predicted[-len(hash_layers) :] == requested[n:]
            return predicted, requested

    predicted, requested = asyncio.run(run())
    assert predicted and len(requested) == 11 * len(hash_layers)
    assert predicted[: len(hash_layers)] == requested[: len(hash_layers)]


def _config(store):
    from colibri.io.format import open_store

    return open_store(store).config


@pytest.mark.parametrize("batch", ["split", "fused"])
def test_batched_forward_matches_each_sequence_alone(v4, batch):
    """The scheduler's batched forward (batch="fused": one stacked array of residual
    streams; "split": per sequence) gives each sequence exactly the logits it gets alone."""
    _model, store, ids, _ref = v4

    async def run():
        async with open_engine(store, activations="f32", batch=batch) as eng:
            alone = []
            for toks in (ids[:13], ids[13:40]):
                alone.append(await eng.forward(eng.new_sequence(), toks))
            a, b = eng.new_sequence(), eng.new_sequence()
            got = await eng.pipeline.forward_batch([(ids[:13], a.kv), (ids[13:40], b.kv)])
            for g, w in zip(got, alone, strict=True):
                np.testing.assert_array_equal(g, w)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_key_value_heads", 2, "num_key_value_heads"),
        ("scoring_func", "softmax", "scoring_func"),
        ("mlp_bias", True, "mlp_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        (
            "layer_types",
            ["sliding_attention", "full_attention", "sliding_attention"],
            "layer_types",
        ),
        ("mlp_layer_types", ["moe", "dense", "moe"], "mlp_layer_types"),
        ("o_groups", 3, "o_groups"),
        ("partial_rotary_factor", 0.01, "partial_rotary_factor"),
        ("index_head_dim", 4, "index_head_dim"),
    ],
)
def test_unsupported_config_values_are_refused(field, value, match):
    cfg = hf_models.config(CASE).to_dict() | {field: value}
    with pytest.raises(StoreError, match=match):
        model_spec(cfg)


def test_bad_tid2eid_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = hf_models.build(CASE, seed=1)
    src = hf_models.save(model, tmp_path / "hf")
    f = src / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.ffn.gate.tid2eid"][3, 0] = 99  # 8 experts
    save_file(tensors, f, metadata={"format": "pt"})
    convert(src, tmp_path / "s", quant="f32", dense_quant="f32")

    async def run():
        async with open_engine(tmp_path / "s"):
            pass

    with pytest.raises(StoreError, match=r"tid2eid must hold expert ids in \[0, 8\)"):
        asyncio.run(run())


def test_session_reopened_continues_exactly(v4, tmp_path):
    """A session saved mid-sequence (window rings, compressor entries and windows included)
    and loaded into a fresh engine continues with bit-identical logits."""
    _model, store, ids, _ref = v4
    path = tmp_path / "s.session"

    async def first():
        async with open_engine(store, activations="f32") as eng:
            s = eng.new_session([])
            await eng.forward(s.seq, ids[:27])  # windows of 4 and 8 left half full
            eng.save_session(path, s)
            return await eng.forward(s.seq, ids[27:])

    async def reopened():
        async with open_engine(store, activations="f32") as eng:
            s = eng.load_session(path)
            assert s.seq.length == 27
            return await eng.forward(s.seq, ids[27:])

    want = asyncio.run(first())
    np.testing.assert_array_equal(asyncio.run(reopened()), want)


def test_transformers_layout_converts_to_the_same_store(v4, tmp_path):
    """A checkpoint saved in transformers' own layout (module names, fused gate_up_proj
    experts) converts to the same tensor names and runs to the same logits as the original
    spelling save_pretrained writes by default."""
    from colibri.io.format import open_store

    model, store, ids, _ref = v4
    src = hf_models.save(model, tmp_path / "hf", save_original_format=False)
    assert any(".mlp.experts.gate_up_proj" in p.read_text(errors="ignore")[:100000]
               for p in src.glob("*.safetensors"))  # fmt: skip
    convert(src, tmp_path / "s", quant="f32", dense_quant="f32")
    assert open_store(tmp_path / "s").dense_names() == open_store(store).dense_names()

    async def run(path):
        async with open_engine(path, activations="f32") as eng:
            return await eng.forward(eng.new_sequence(), ids)

    np.testing.assert_array_equal(asyncio.run(run(tmp_path / "s")), asyncio.run(run(store)))


def _compress_tokenwise(c, kvx, gx, ape, norm_w, eps, buf, entries, pos0, a):
    """The compressor fed one token at a time: the per-token loop dsv4.compress replaced
    (kept here as its reference; the same formulas, spec.CompressorSpec)."""
    m, D = c.compress_rate, c.head_dim
    done = []
    for s in range(kvx.shape[0]):
        win, slot = divmod(pos0 + s, m)
        par = win % 2
        buf[0, par, slot] = kvx[s]
        buf[1, par, slot] = gx[s] + ape[slot]
        if slot != m - 1:
            continue
        if not c.overlap:
            kv_w, g_w = buf[0, par], buf[1, par]
        elif win == 0:
            kv_w, g_w = buf[0, par, :, D:], buf[1, par, :, D:]
        else:
            kv_w = np.concatenate([buf[0, 1 - par, :, :D], buf[0, par, :, D:]])
            g_w = np.concatenate([buf[1, 1 - par, :, :D], buf[1, par, :, D:]])
        z = np.exp(g_w - g_w.max(axis=0, keepdims=True)).astype(np.float32)
        z /= z.sum(axis=0, keepdims=True)
        done.append((win, (kv_w * z).sum(axis=0, dtype=np.float32)))
    if done:
        rows = np.ascontiguousarray(np.stack([v for _, v in done]))
        dsv4.ops.rmsnorm(rows, rows, norm_w, eps)
        wins = np.array([w for w, _ in done], dtype=np.int32)
        t = rows[:, None, :]
        dsv4.rope_tail(t, wins * np.int32(m), a)
        entries[wins] = t[:, 0]


@pytest.mark.parametrize(("rate", "overlap"), [(4, True), (8, False), (128, False), (4, False)])
def test_compressor_chunking_is_bit_exact(rate, overlap):
    """The vectorised compressor gives the token-by-token loop's entries and window state
    bit for bit, fed in one shot, token by token, or in uneven chunks that open and close
    windows inside and across calls."""
    from colibri.models.spec import CompressorSpec

    spec = model_spec(hf_models.config(CASE).to_dict())
    a = next(layer.attention for layer in spec.layers if layer.attention.shared_kv.compressor)
    D = a.head_dim
    c = CompressorSpec(rate, D, overlap)
    width = D * (1 + overlap)
    rng = np.random.default_rng(rate + overlap)
    n = 3 * rate + rate // 2 + 3
    kvx, gx = (rng.standard_normal((n, width), dtype=np.float32) for _ in range(2))
    ape = rng.standard_normal((rate, width), dtype=np.float32)
    norm_w = 1 + 0.3 * rng.standard_normal(D, dtype=np.float32)

    def run(fn, cuts):
        buf = np.zeros((2, 2, rate, width), np.float32)
        entries = np.full((n // rate + 1, D), np.nan, np.float32)
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            fn(c, kvx[lo:hi], gx[lo:hi], ape, norm_w, 1e-6, buf, entries, lo, a)
        return entries, buf

    want = run(_compress_tokenwise, list(range(1, n)))
    for cuts in ([], list(range(1, n)), [1, 2, rate - 1, rate + 3, 2 * rate + 1, 3 * rate]):
        for got, ref in zip(run(dsv4.compress, cuts), want, strict=True):
            np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(run(_compress_tokenwise, [])[0], want[0])
