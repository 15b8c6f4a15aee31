"""The K-quant GEMM on Q8_K activations (csrc/kquants_gemm.c, arch/kquants_gemm.inc): Q8_K
bytes against a numpy port of ggml's quantize_row_q8_K_ref (gguf has no Q8_K codec),
products against float64 dequantize-then-matmul references (weights decoded by gguf), and one
computation for every ISA level, tile, thread count and batch size (batch invariance)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops
from colibri.errors import KernelError
from tests.kernel_util import random_weights

TYPES = [ops.QType.Q4_K, ops.QType.Q5_K, ops.QType.Q6_K]
ISAS = [i for i in ops.ISA if i <= ops.best_isa()]


@pytest.fixture(autouse=True)
def _restore_isa():
    before = ops.isa()
    yield
    ops.set_isa(before)


def q8k_reference(x: np.ndarray) -> np.ndarray:
    """numpy port of ggml's quantize_row_q8_K_ref -> block_q8_K bytes [rows, cols / 256 * 292]:
    the value of largest magnitude (first of ties) -> -127, d = 1 / (-127 / max), q =
    round-half-even(x * (-127 / max)) capped at 127, int16 sums of q per 16."""
    rows, cols = x.shape
    xb = x.reshape(rows, cols // 256, 256).astype(np.float32)
    idx = np.abs(xb).argmax(axis=-1)
    mx = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint((iscale[..., None] * xb).astype(np.float32)), 127).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    bs = q.reshape(rows, cols // 256, 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    out = np.concatenate(
        [d[..., None].view(np.uint8), q.view(np.uint8), bs.view(np.uint8)], axis=-1
    )
    return out.reshape(rows, -1)


def q8k_dequantize(xq: np.ndarray, cols: int) -> np.ndarray:
    """block_q8_K bytes [n, cols / 256 * 292] -> float32 d * q [n, cols]."""
    b = xq.reshape(len(xq), cols // 256, 292)
    d = b[..., :4].copy().view(np.float32)
    return (d * b[..., 4:260].view(np.int8).astype(np.float32)).reshape(len(xq), cols)


def _x(rng: np.random.Generator, n: int, cols: int) -> np.ndarray:
    x = rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, (n, 1))
    x[:, 7] *= 30  # an outlier per block row
    return x.astype(np.float32)


def test_q8k_bytes_equal_ggml_reference():
    rng = np.random.default_rng(0)
    x = _x(rng, 9, 768)
    x[3, :256] = 0  # an all-zero block: d = 0, q = 0
    x[4, 300] = -np.abs(x[4]).max() * 2  # a negative extreme: it becomes +127
    got = ops.quantize_q8_k(x)
    np.testing.assert_array_equal(got, q8k_reference(x))
    deq = q8k_dequantize(got, 768)
    assert np.abs(deq - x).max() <= np.abs(x).max() / 127  # half a step of the largest scale
    q = got.reshape(9, 3, 292)[..., 4:260].view(np.int8)
    assert q.min() >= -127 and q.max() <= 127


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize(("rows", "cols", "n"), [(8, 256, 1), (37, 512, 5), (19, 1024, 70)])
def test_matmul_q8k_matches_dequantized_reference(qt, rows, cols, n):
    """y = dequant(W) @ dequant(Q8_K(x))^T in float64 (W decoded by gguf) within f32
    accumulation error, at every ISA level."""
    rng = np.random.default_rng(int(qt) * 100 + rows)
    w, wf = random_weights(rng, qt, rows, cols)
    xq = ops.quantize_q8_k(_x(rng, n, cols))
    xf = q8k_dequantize(xq, cols)
    want = xf.astype(np.float64) @ wf.astype(np.float64).T
    for isa in ISAS:
        ops.set_isa(isa)
        got = ops.matmul_q8k(w, qt, xq, np.empty((n, rows), np.float32))
        scale = np.abs(xf).astype(np.float64) @ np.abs(wf).astype(np.float64).T
        assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), isa


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_one_computation_for_every_isa_batch_and_thread_count(qt):
    """Bit-identical rows whatever the ISA level (scalar twin included), the number of x rows
    in the call (1, 2, 7, 64, 65 and 130: across panels), the tile a weight row falls in (41
    rows: a tail tile) and the thread count."""
    rng = np.random.default_rng(int(qt))
    rows, cols, n = 41, 512, 130
    w, _ = random_weights(rng, qt, rows, cols)
    xq = ops.quantize_q8_k(_x(rng, n, cols))
    ops.set_isa(ops.ISA.SCALAR)
    want = ops.matmul_q8k(w, qt, xq, np.empty((n, rows), np.float32), nthreads=1)
    for isa in ISAS:
        ops.set_isa(isa)
        for nt in (1, 2):
            got = ops.matmul_q8k(w, qt, xq, np.empty((n, rows), np.float32), nthreads=nt)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        for m in (1, 2, 7, 64, 65):
            for i0 in (0, n - m):
                part = ops.matmul_q8k(w, qt, xq[i0 : i0 + m], np.empty((m, rows), np.float32))
                np.testing.assert_array_equal(
                    part.view(np.uint32), want[i0 : i0 + m].view(np.uint32)
                )
        one = ops.matmul_q8k(w, qt, xq[5], np.empty(rows, np.float32))
        np.testing.assert_array_equal(one.view(np.uint32), want[5].view(np.uint32))
        # a row range that starts mid-tile: the weight rows' tile does not matter either
        sub = ops.matmul_q8k(
            np.ascontiguousarray(w[3:]), qt, xq, np.empty((n, rows - 3), np.float32)
        )
        np.testing.assert_array_equal(sub.view(np.uint32), want[:, 3:].view(np.uint32))


def _extreme_blocks(rng: np.random.Generator, qt: ops.QType, rows: int, cols: int) -> np.ndarray:
    """Random block bytes (every level, scale and min value occurs) with finite f16 d / dmin,
    and row 0 at the extremes: every quant byte 0xff (Q4_K levels 15, Q5_K 31, Q6_K 63; Q4_K /
    Q5_K scales and mins 63), Q6_K's scales -128."""
    nb = ops.row_nbytes(qt, cols) // (cols // 256)
    b = rng.integers(0, 256, (rows, cols // 256, nb), dtype=np.uint8)
    b[0] = 0xFF
    d_at = (208,) if qt == ops.QType.Q6_K else (0, 2)
    for o in d_at:  # f16 in [2^-12, 2^-6): finite, varied
        b[..., o : o + 2] = (
            (rng.integers(0, 1024, b.shape[:2]) | (3 << 10))
            .astype(np.uint16)[..., None]
            .view(np.uint8)
        )
    if qt == ops.QType.Q6_K:
        b[0, :, 192:208] = 0x80
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qt", TYPES, ids=lambda q: q.name)
def test_decode_tiles_at_extreme_levels_and_many_blocks(qt):
    """The decode tiles (1-2 x rows, 8 weight rows at a time, KQG_TB = 16 blocks a pass) at the
    largest products the int16 steps must hold (all levels and scales at their maximum against
    x = +-127) and past a pass (17 blocks): the scalar twin's bits at every ISA level, alone
    and in a batch, 1 and 2 threads, and gguf's dequantized product within f32 rounding."""
    from colibri.compute import ref

    rng = np.random.default_rng(7 + int(qt))
    rows, cols, n = 19, 17 * 256, 3
    w = _extreme_blocks(rng, qt, rows, cols)
    wf = ref.dequantize(w, int(qt), (rows, cols))
    x = _x(rng, n, cols)
    x[0] = np.where(np.arange(cols) % 3 == 0, -1.0, 1.0)  # every q = +-127
    x[1] = 1.0
    xq = ops.quantize_q8_k(x)
    xf = q8k_dequantize(xq, cols)
    want64 = xf.astype(np.float64) @ wf.astype(np.float64).T
    tol = 1e-5 * (np.abs(xf).astype(np.float64) @ np.abs(wf).astype(np.float64).T)
    ops.set_isa(ops.ISA.SCALAR)
    want = ops.matmul_q8k(w, qt, xq, np.empty((n, rows), np.float32), nthreads=1)
    assert np.all(np.abs(want - want64) <= tol)
    for isa in ISAS:
        ops.set_isa(isa)
        for nt in (1, 2):
            for i in range(n):
                one = ops.matmul_q8k(w, qt, xq[i], np.empty(rows, np.float32), nthreads=nt)
                np.testing.assert_array_equal(one.view(np.uint32), want[i].view(np.uint32))
            two = ops.matmul_q8k(w, qt, xq[:2], np.empty((2, rows), np.float32), nthreads=nt)
            np.testing.assert_array_equal(two.view(np.uint32), want[:2].view(np.uint32))


def test_matmul_q8k_refuses_bad_arguments():
    rng = np.random.default_rng(1)
    w, _ = random_weights(rng, ops.QType.Q4_K, 8, 256)
    xq = ops.quantize_q8_k(_x(rng, 2, 256))
    with pytest.raises(KernelError, match="must be one of Q4_K, Q5_K, Q6_K, got Q4_0"):
        ops.matmul_q8k(w, "q4_0", xq, np.empty((2, 8), np.float32))
    with pytest.raises(KernelError, match="w has 1152 bytes"):
        ops.matmul_q8k(w, "q4_k", xq, np.empty((2, 9), np.float32))
    with pytest.raises(KernelError, match="not Q8_K blocks"):
        ops.matmul_q8k(w, "q4_k", xq[:, :-1].copy(), np.empty((2, 8), np.float32))
    with pytest.raises(KernelError, match="not a multiple of 256"):
        ops.quantize_q8_k(np.zeros((2, 96), np.float32))


def _ffn_reference(x, gf, uf, df, rw):
    """(y, slack): the SwiGLU FFN on Q8_K activations in float64 (x and h rounded to f32 go
    through the numpy Q8_K reference); slack = the L2 change rounding ties of h allow (h / d_h
    within 1e-3 of k + 0.5 may round either way from the kernel's f32 h)."""
    from colibri.compute import ref

    xd = q8k_dequantize(q8k_reference(x), x.shape[1]).astype(np.float64)
    h = ref._act(xd @ gf.astype(np.float64).T, xd @ uf.astype(np.float64).T, 0, 1.702, 7.0)
    h32 = h.astype(np.float32)
    hd = q8k_dequantize(q8k_reference(h32), h32.shape[1]).astype(np.float64)
    y = (hd @ df.astype(np.float64).T) * rw[:, None]
    hb = h32.reshape(len(x), -1, 256)
    dh = np.abs(hb).max(axis=2, keepdims=True) / 127
    steps = np.abs(hb) / np.where(dh > 0, dh, 1)
    tie = np.abs(steps - np.floor(steps) - 0.5) < 1e-3
    col = np.linalg.norm(df, axis=0).reshape(-1, 256)
    return y, float((tie * dh * col[None] * rw[:, None, None]).sum())


@pytest.mark.parametrize(
    "types",
    [("q4_k", "q4_k", "q6_k"), ("q5_k", "q5_k", "q5_k"), ("q6_k", "q4_k", "q4_k")],
    ids="/".join,
)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_expert_ffn_q8k_matches_reference_and_is_batch_invariant(types):
    """The fused FFN on Q8_K activations (a Q4_K_M-style record: Q6_K down) against the
    float64 FFN of gguf-dequantized weights on Q8_K round trips of x and h; and each token's
    row the same bits alone as among 11 tokens, at every ISA level and thread count."""
    from tests.kernel_util import FFN_TOL

    rng = np.random.default_rng(len("".join(types)))
    d_model, d_ff, n = 512, 768, 11
    qts = [ops.QType.parse(t) for t in types]
    (g, gf), (u, uf), (d, df) = (
        random_weights(rng, qts[0], d_ff, d_model),
        random_weights(rng, qts[1], d_ff, d_model),
        random_weights(rng, qts[2], d_model, d_ff),
    )
    x = (0.5 * rng.standard_normal((n, d_model))).astype(np.float32)
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    bias = rng.standard_normal(d_model).astype(np.float32)

    def ffn(rows: slice, nt: int = 0, bias: np.ndarray | None = None) -> np.ndarray:
        xs = np.ascontiguousarray(x[rows])
        return ops.expert_ffn_q8k(
            np.empty_like(xs), xs, g, u, d, types, d_model, d_ff, down_bias=bias,
            row_weight=np.ascontiguousarray(rw[rows]), accumulate=False, nthreads=nt,
        )  # fmt: skip

    want, slack = _ffn_reference(x, gf, uf, df, rw)
    y = ffn(slice(0, n))
    assert np.linalg.norm(y - want) <= FFN_TOL * np.linalg.norm(want) + slack
    ops.set_isa(ops.ISA.SCALAR)
    bits = ffn(slice(0, n), 1, bias).view(np.uint32)
    for isa in ISAS:
        ops.set_isa(isa)
        for nt in (1, 2):
            np.testing.assert_array_equal(ffn(slice(0, n), nt, bias).view(np.uint32), bits)
        for i in range(n):
            np.testing.assert_array_equal(
                ffn(slice(i, i + 1), 0, bias).view(np.uint32), bits[i : i + 1]
            )
    with pytest.raises(KernelError, match="must be Q4_K, Q5_K or Q6_K"):
        ops.expert_ffn_q8k(np.empty_like(x), x, g, u, d, ("q4_k", "q4_0", "q6_k"), d_model, d_ff)


def test_engine_runs_k_quant_experts_on_q8k_activations(tmp_path, monkeypatch):
    """activations="q8_k" (also the engine's default): a Q4_K-expert store routes its experts
    through expert_ffn_q8k or expert_ffn_group(q8k=True) (and activations="q8_0" does not),
    and its logits (an 8-token prefill, then decode steps, teacher-forced) stay within the KL
    bound of test_convert_quantized's q4_k case from the f32 store's."""
    import asyncio

    pytest.importorskip("torch")
    from colibri.convert import convert
    from colibri.engine import open_engine
    from tests import hf_models

    model = hf_models.build("mixtral", seed=17, hidden_size=256, intermediate_size=256)
    src = hf_models.save(model, tmp_path / "hf")
    ids = hf_models.greedy(model, list(range(3, 19)), 16)
    calls = []
    real, group = ops.expert_ffn_q8k, ops.expert_ffn_group
    monkeypatch.setattr(ops, "expert_ffn_q8k", lambda *a, **k: calls.append(1) or real(*a, **k))

    # a trip's ready experts in one call (the pipeline's usual path): its q8k flag
    def spy_group(*a, **k):
        if k.get("q8k"):
            calls.append(1)
        return group(*a, **k)

    monkeypatch.setattr(ops, "expert_ffn_group", spy_group)

    def forced(store, activations):
        async def run():
            kw = {"activations": activations} if activations else {}
            async with open_engine(store, **kw) as engine:
                seq = engine.new_sequence()
                out = [await engine.forward(seq, ids[:8])]  # a prefill, then decode steps
                for t in ids[8:-1]:
                    out.append(await engine.forward(seq, [t]))
                return np.concatenate([np.atleast_2d(o) for o in out])

        return asyncio.run(run()).astype(np.float64)

    f32 = forced(convert(src, tmp_path / "f32", quant="f32", dense_quant="f32"), "f32")
    store = convert(src, tmp_path / "k", quant="q4_k", dense_quant="q8_0")
    kl = {}
    for mode in ("q8_0", "q8_k", None):
        calls.clear()
        q = forced(store, mode)
        assert bool(calls) == (mode != "q8_0"), mode
        logp = f32 - np.logaddexp.reduce(f32, axis=1, keepdims=True)
        logq = q - np.logaddexp.reduce(q, axis=1, keepdims=True)
        kl[mode] = float((np.exp(logp) * (logp - logq)).sum(axis=1).mean())
    assert kl["q8_k"] < 0.15, kl
    assert kl[None] == kl["q8_k"], kl


def test_dense_k_quant_matrices_run_on_q8k():
    """A dense Linear of a Q8K_ACT_TYPES matrix with act_q8k (the engine's default q8_k) is
    matmul_q8k on quantize_q8_k(x), bit for bit, alone or batched; other column counts and
    activations="q8_0" keep Q8_0 activations."""
    from colibri.model import Linear

    rng = np.random.default_rng(3)
    w, _ = random_weights(rng, ops.QType.Q6_K, 40, 512)
    x = _x(rng, 5, 512)
    lin = Linear(w, ops.QType.Q6_K, 40, 512, None, act_q8=True, act_q8k=True)
    assert lin.act_q8k and lin.row_invariant
    want = ops.matmul_q8k(w, "q6_k", ops.quantize_q8_k(x), np.empty((5, 40), np.float32))
    np.testing.assert_array_equal(lin(x).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(lin(x[2:3])[0].view(np.uint32), want[2].view(np.uint32))
    assert not Linear(w, ops.QType.Q6_K, 40, 512, None, act_q8=True).act_q8k
    w4, _ = random_weights(rng, ops.QType.Q4_0, 8, 96)
    assert not Linear(w4, ops.QType.Q4_0, 8, 96, None, act_q8=True, act_q8k=True).act_q8k


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_k_quant_shared_expert_runs_on_q8k_as_the_routed_experts(tmp_path, monkeypatch):
    """activations="q8_k": a Qwen2-MoE shared expert stored in Q4_K (dense_quant q4_k) runs on
    Q8_K activations, the routed K-quant experts' rule, and matches the float64 FFN of its
    gguf-dequantized weights on Q8_K round trips of h and the hidden, times
    sigmoid(shared_expert_gate h); activations="q8_0" keeps it on Q8_0."""
    pytest.importorskip("torch")
    gguf = pytest.importorskip("gguf")
    from colibri.convert import convert
    from colibri.io.format import open_store
    from colibri.model import Model
    from colibri.registry import model_spec
    from tests import hf_models
    from tests.kernel_util import FFN_TOL

    dims = {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256}
    model = hf_models.build("qwen2_moe", seed=4, shared_expert_intermediate_size=256, **dims)
    src = hf_models.save(model, tmp_path / "hf")
    store = open_store(convert(src, tmp_path / "k", quant="q4_k", dense_quant="q4_k"))
    spec = model_spec(store.config)
    names = store.dense_names()
    i = next(
        j
        for j in range(len(spec.layers))
        if f"model.layers.{j}.mlp.shared_expert_gate.weight" in names
    )
    p = f"model.layers.{i}.mlp.shared_expert"
    assert all(store.dense_qtype(f"{p}.{n}.weight") == "q4_k" for n in ("gate_proj", "down_proj"))

    def weight(name: str) -> np.ndarray:
        raw, qtype, shape = store.dense(name)
        assert qtype == "q4_k", name
        q4k = gguf.GGMLQuantizationType.Q4_K
        return gguf.quants.dequantize(np.asarray(raw).reshape(shape[0], -1), q4k)

    gf, uf, df = (weight(f"{p}.{n}_proj.weight") for n in ("gate", "up", "down"))
    g_w = np.asarray(store.dense(f"model.layers.{i}.mlp.shared_expert_gate.weight")[0])
    h = (0.5 * np.random.default_rng(0).standard_normal((5, 256))).astype(np.float32)
    want, slack = _ffn_reference(h, gf, uf, df, np.ones(5, np.float32))
    want *= 1.0 / (1.0 + np.exp(-(h.astype(np.float64) @ g_w.astype(np.float64).T)))

    calls = []
    real = ops.expert_ffn_q8k
    monkeypatch.setattr(ops, "expert_ffn_q8k", lambda *a, **k: calls.append(1) or real(*a, **k))
    for activations in ("q8_k", "q8_0"):
        calls.clear()
        m = Model(store, spec, activations=activations)
        out = np.zeros_like(h)
        m.dense_ffn(i, h, out)
        assert bool(calls) == (activations == "q8_k"), activations
        if activations == "q8_k":
            assert np.linalg.norm(out - want) <= FFN_TOL * np.linalg.norm(want) + slack
            alone = np.zeros_like(h[:1])
            m.dense_ffn(i, np.ascontiguousarray(h[2:3]), alone)  # batch invariant
            np.testing.assert_array_equal(alone[0].view(np.uint32), out[2].view(np.uint32))
