"""MLA's kv_b_proj read in its storage type (issue 13 item 6): the per-head kernels
(ops.mla_absorb_q / mla_values / mla_values_q8, every ISA) against a numpy
dequantize-then-matmul reference built on the `gguf` package's (de)quantizers, over a grid of
shapes; the engine on a block-quantized dense store against the f32-expanded path it replaces;
resident dense memory that no longer holds an f32 copy; placement invariance of an MLA model."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from colibri import model as model_mod
from colibri.compute import ops
from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import KernelError
from colibri.io.format import open_store
from colibri.model import Model
from colibri.registry import model_spec
from tests import hf_models

ISAS = [i for i in ops.ISA if i <= ops.best_isa()]
QTYPES = ["q8_0", "q4_0", "q4_1", "f32", "f16", "bf16"]
# (n_heads, nope, dv, rank, rope, n_tokens)
SHAPES = [(1, 1, 1, 32, 0, 1), (3, 16, 12, 64, 8, 5), (4, 24, 40, 96, 16, 9), (2, 7, 5, 160, 4, 2)]


def _gguf_q(w: np.ndarray, qtype: str) -> np.ndarray:
    return quants.quantize(w, GGMLQuantizationType[qtype.upper()])


def _gguf_dq(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return quants.dequantize(data, GGMLQuantizationType[qtype.upper()]).reshape(shape)


def _kv_b(rng, qtype, heads, nope, dv, rank):
    """(stored kv_b bytes / array, its dequantized f64 values [heads, nope + dv, rank])."""
    w = rng.standard_normal((heads * (nope + dv), rank)).astype(np.float32)
    data = _gguf_q(w, qtype) if qtype != "f32" else w
    deq = _gguf_dq(data, qtype, w.shape) if qtype != "f32" else w
    return np.ascontiguousarray(data), deq.astype(np.float64).reshape(heads, nope + dv, rank)


@pytest.fixture(params=ISAS, ids=lambda i: i.name.lower())
def isa(request):
    before = ops.isa()
    ops.set_isa(request.param)
    yield request.param
    ops.set_isa(before)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("nthreads", [1, 2])
def test_kernels_match_dequantize_then_matmul(isa, qtype, shape, nthreads):
    heads, nope, dv, rank, rope, n = shape
    rng = np.random.default_rng(zlib.crc32(repr((qtype, shape)).encode()))
    data, w = _kv_b(rng, qtype, heads, nope, dv, rank)
    tol = 1e-5 * np.sqrt(max(nope, rank))  # f32 accumulation of O(1) terms
    # absorbed query: q [n, H, nope + rope] -> out [n, H, rank + rope], rope part untouched
    q = rng.standard_normal((n, heads, nope + rope)).astype(np.float32)
    out = np.full((n, heads, rank + rope), 7.0, np.float32)
    ops.mla_absorb_q(data, qtype, q, out, nope=nope, dv=dv, rank=rank, nthreads=nthreads)
    ref = np.einsum("thj,hjc->thc", q[:, :, :nope].astype(np.float64), w[:, :nope])
    np.testing.assert_allclose(out[:, :, :rank], ref, rtol=0, atol=tol * np.abs(ref).max())
    assert (out[:, :, rank:] == 7.0).all()
    # values: lat [n, H, rank + rope] -> [n, H, dv]
    lat = rng.standard_normal((n, heads, rank + rope)).astype(np.float32)
    v = np.empty((n, heads, dv), np.float32)
    ops.mla_values(data, qtype, lat, v, nope=nope, rank=rank, nthreads=nthreads)
    ref = np.einsum("thc,hvc->thv", lat[:, :, :rank].astype(np.float64), w[:, nope:])
    np.testing.assert_allclose(v, ref, rtol=0, atol=tol * np.abs(ref).max())
    if qtype in ("q8_0", "q4_0"):
        # Q8_0 activations: the reference multiplies gguf's dequantized activation blocks
        xq = ops.quantize_act(np.ascontiguousarray(lat[:, :, :rank]))
        assert (xq == _gguf_q(np.ascontiguousarray(lat[:, :, :rank]), "q8_0")).all()
        xd = _gguf_dq(xq, "q8_0", (n, heads, rank)).astype(np.float64)
        v.fill(np.nan)
        ops.mla_values_q8(data, qtype, xq, v, nope=nope, nthreads=nthreads)
        ref = np.einsum("thc,hvc->thv", xd, w[:, nope:])
        np.testing.assert_allclose(v, ref, rtol=0, atol=tol * np.abs(ref).max())


def test_kernel_errors_name_the_problem():
    rng = np.random.default_rng(0)
    data, _ = _kv_b(rng, "q8_0", 2, 4, 4, 32)
    q = np.zeros((1, 2, 6), np.float32)
    out = np.zeros((1, 2, 34), np.float32)
    with pytest.raises(KernelError, match="kv_b has 1 bytes"):
        ops.mla_absorb_q(data[:1, :1].copy(), "q8_0", q, out, nope=4, dv=4, rank=32)
    with pytest.raises(KernelError, match="needs >= 4"):
        ops.mla_absorb_q(data, "q8_0", q[:, :, :3].copy(), out, nope=4, dv=4, rank=32)
    with pytest.raises(KernelError, match="differ in tokens or heads"):
        ops.mla_absorb_q(data, "q8_0", np.zeros((2, 2, 6), np.float32), out, nope=4, dv=4, rank=32)
    with pytest.raises(KernelError, match="must be Q4_0 or Q8_0"):
        ops.mla_values_q8(data, "q4_1", np.zeros((1, 2, 34), np.uint8), out, nope=4)
    with pytest.raises(KernelError, match="float32"):
        ops.mla_values(data, "q8_0", q.astype(np.float64), np.zeros((1, 2, 4), np.float32),
                       nope=4, rank=32)  # fmt: skip


# ---- the engine ----------------------------------------------------------------------------

MLA_CASES = ["deepseek_v3", "glm4_moe_lite_no_q_lora_yarn"]


@pytest.fixture(scope="module", params=MLA_CASES)
def mla_pair(request, tmp_path_factory):
    case = request.param
    model = hf_models.build(case, seed=4)
    root = tmp_path_factory.mktemp(case)
    return case, model, hf_models.save(model, root / "hf"), root


def _dense_bytes(store) -> int:
    """Bytes of every dense tensor as the store holds it (blocks, or f32 arrays)."""
    return sum(store.dense(name)[0].nbytes for name in store.dense_names())


@pytest.mark.parametrize("dense_quant", ["q8_0", "q4_0", "f32"])
def test_kv_b_stays_in_its_storage_type(mla_pair, dense_quant):
    """A block-quantized kv_b_proj is resident as its blocks (no f32 copy): the model's
    resident dense bytes are exactly the store's; an f32 one keeps the absorbed f32 arrays
    (today's path, the same values), also exactly the store's bytes."""
    _case, _model, src, root = mla_pair
    out = convert(src, root / f"s_{dense_quant}", quant="q8_0", dense_quant=dense_quant)
    store = open_store(out)
    spec = model_spec(store.config)
    m = Model(store, spec, activations="f32")
    assert m.dense_nbytes == _dense_bytes(store)
    f32_copy = 0  # what the old path kept: kv_b expanded to f32
    for layer, w in zip(spec.layers, m.layers, strict=True):
        kv_b, qtype, shape = store.dense(f"{layer.names['kv_b']}.weight")
        assert qtype == dense_quant
        if dense_quant == "f32":
            assert "kv_b" not in w and w["w_uk"].dtype == np.float32
        else:
            assert w["kv_b"].w is not None and w["kv_b"].w.dtype == np.uint8
            assert "w_uk" not in w and "w_uv_t" not in w
        f32_copy += 4 * shape[0] * shape[1] - kv_b.nbytes
    if dense_quant != "f32":
        assert f32_copy > 0  # the bytes the old path added on top of the store's


async def _logits(store, ids, n, **options):
    return await hf_models.engine_greedy(store, ids, n, **options)


@pytest.mark.parametrize("dense_quant", ["q8_0", "q4_0"])
async def test_quantized_kv_b_matches_the_f32_expanded_path(mla_pair, dense_quant, monkeypatch):
    """Same weights, two paths: the kernels on kv_b's blocks and the dequantized f32 absorbed
    arrays (MLA_KV_B_QTYPES emptied) give logits within f32 summation noise and the same
    greedy tokens (f32 activations); with Q8_0 activations the output stays within the
    q8_0-activation KL bound of test_engine_exact."""
    case, _model, src, root = mla_pair
    out = convert(src, root / f"p_{dense_quant}", quant="f32", dense_quant=dense_quant)
    ids = list(range(3, 27))
    toks, logits = await _logits(out, ids, 16, activations="f32")
    monkeypatch.setattr(model_mod, "MLA_KV_B_QTYPES", frozenset())
    ref_toks, ref_logits = await _logits(out, ids, 16, activations="f32")
    assert toks == ref_toks, case
    assert np.abs(logits - ref_logits).max() <= 1e-4 * np.abs(ref_logits).max()
    monkeypatch.undo()
    # Q8_0 activations on kv_b too, teacher-forced on the f32 tokens
    async with open_engine(out, activations="q8_0") as engine:
        seq = engine.new_sequence()
        q = [await engine.forward(seq, ids)]
        for tok in toks[:-1]:
            q.append(await engine.forward(seq, [tok]))
    p, q = ref_logits.astype(np.float64), np.stack(q).astype(np.float64)
    logp = p - np.logaddexp.reduce(p, axis=1, keepdims=True)
    logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
    kl = float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())
    assert kl <= 1e-2, (case, dense_quant, kl)


async def test_mla_placement_invariance(mla_pair):
    """An MLA model on quantized kv_b: the same greedy tokens whatever the reader backend,
    cache budget, prefetch and thread count."""
    case, _model, src, root = mla_pair
    out = convert(src, root / "placement", quant="q4_0", dense_quant="q8_0")
    s = open_store(out)
    record, k = s.layout.record_nbytes, s.config["num_experts_per_tok"]
    total = len(s.records) * record
    ids = list(range(5, 21))
    ref, _ = await _logits(out, ids, 10, io="threads", budget=total, prefetch=False, threads=1)
    for io, budget, prefetch, threads in itertools.product(
        ("uring", "mmap"), (k * record, total), (False, True), (1, 2)
    ):
        toks, _ = await _logits(
            out, ids, 10, io=io, budget=budget, prefetch=prefetch, threads=threads
        )
        assert toks == ref, (case, io, budget, prefetch, threads)
