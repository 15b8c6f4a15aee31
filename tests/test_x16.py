"""X16-packed Q4_0 / Q8_0 weights (ops.pack_x16, ops.matmul_q8_x16, Linear.pack_x16): the
layout against a numpy construction of it, and the packed matmul against the row-major one
(bit for bit, every ISA level, batch sizes on both sides of the packed kernel's 15 x rows)
and against the independent numpy reference of tests/test_q8_activations.py."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops
from colibri.errors import KernelError
from colibri.model import Linear
from tests.kernel_util import MATMUL_TOL, random_weights
from tests.test_q8_activations import q8_reference

QTYPES = [ops.QType.Q4_0, ops.QType.Q8_0, ops.QType.MXFP4]
BLOCK = {ops.QType.Q4_0: (18, 2), ops.QType.Q8_0: (34, 2), ops.QType.MXFP4: (17, 1)}


def numpy_x16(w: np.ndarray, qt: ops.QType, cols: int) -> np.ndarray:
    """The X16 layout built with numpy: per 16-row tile and pair of blocks, the 2 x 16 scales
    (f16, or MXFP4's e8m0 byte), then per block G groups of (16 rows x 4 quant bytes)."""
    rows, nb = w.shape[0], cols // 32
    bb, sb = BLOCK[qt]
    g = (bb - sb) // 4
    t = w.reshape(rows // 16, 16, nb, bb)
    sc = t[..., :sb].transpose(0, 2, 1, 3).reshape(rows // 16, nb // 2, 32 * sb)
    q = t[..., sb:].reshape(rows // 16, 16, nb, g, 4).transpose(0, 2, 3, 1, 4)
    q = q.reshape(rows // 16, nb // 2, 2 * g * 64)
    return np.concatenate([sc, q], axis=2).reshape(w.shape)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(16, 64), (48, 128), (32, 4160)])
def test_pack_layout_vs_numpy_and_round_trip(qt, rows, cols):
    rng = np.random.default_rng(rows + cols)
    w, _ = random_weights(rng, qt, rows, cols)
    assert ops.x16_ok(qt, rows, cols)
    p = ops.pack_x16(w, qt, cols)
    np.testing.assert_array_equal(p, numpy_x16(w, qt, cols))
    np.testing.assert_array_equal(ops.unpack_x16(p, qt, cols), w)
    inplace = w.copy()
    assert ops.pack_x16(inplace, qt, cols, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, p)
    assert ops.unpack_x16(inplace, qt, cols, out=inplace) is inplace
    np.testing.assert_array_equal(inplace, w)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(16, 64), (80, 192), (272, 1088)])
def test_matmul_q8_x16_bit_equal_to_rows(isa, qt, rows, cols):
    """Every batch size gives matmul_q8's bits on the GGML rows (on AVX512-VNNI the packed
    tile kernel up to 8 x rows, then the GEMMs on packed tiles: 16 x rows in the lanes with
    and without an 8-lane tail column, 16-row tiles; unpacked tiles on the other levels), 1
    and 2 threads, 1-D x; and the independent reference's values."""
    rng = np.random.default_rng(rows * 31 + cols)
    w, _ = random_weights(rng, qt, rows, cols)
    p = ops.pack_x16(w, qt, cols)
    x = rng.standard_normal((40, cols)).astype(np.float32)
    x[1] *= 1e-3
    xq = ops.quantize_act(x)
    for n in (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 20, 23, 40):
        for t in (1, 2):
            want = ops.matmul_q8(w, qt, xq[:n], np.empty((n, rows), np.float32), nthreads=t)
            got = ops.matmul_q8_x16(p, qt, xq[:n], np.full((n, rows), np.nan, np.float32), t)
            np.testing.assert_array_equal(got, want, err_msg=f"n={n} t={t}")
    y1 = ops.matmul_q8_x16(p, qt, xq[7], np.empty(rows, np.float32))
    np.testing.assert_array_equal(y1, got[7])
    if qt != ops.QType.MXFP4:  # (MXFP4's matmul_q8 has its own reference tests)
        ref, mag = q8_reference(w, qt, x)
        assert np.max(np.abs(got - ref) / mag) <= MATMUL_TOL


def test_x16_bad_arguments():
    rng = np.random.default_rng(0)
    w, _ = random_weights(rng, ops.QType.Q8_0, 16, 96)  # 3 blocks: no pairs
    assert not ops.x16_ok(ops.QType.Q8_0, 16, 96)
    assert not ops.x16_ok(ops.QType.Q8_0, 24, 128)  # not whole tiles
    assert not ops.x16_ok(ops.QType.Q4_1, 16, 128)
    with pytest.raises(KernelError):
        ops.pack_x16(w, ops.QType.Q8_0, 96)
    w, _ = random_weights(rng, ops.QType.Q4_0, 16, 128)
    with pytest.raises(KernelError):
        ops.pack_x16(w, ops.QType.Q8_0, 128)  # wrong row size for the type
    with pytest.raises(KernelError):
        ops.pack_x16(w, ops.QType.Q4_0, 128, out=np.empty((16, 71), np.uint8))
    xq = ops.quantize_act(np.ones(128, np.float32))
    with pytest.raises(KernelError):
        ops.matmul_q8_x16(w, ops.QType.Q4_1, xq, np.empty(16, np.float32))
    with pytest.raises(KernelError):
        ops.matmul_q8_x16(w[:8], ops.QType.Q4_0, xq, np.empty(8, np.float32))


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_linear_pack_keeps_bits(qt):
    """Linear.pack_x16 (the model's LM head and attention projections) packs where this CPU
    has the kernel and the shape the layout, and its outputs keep their bits."""
    rng = np.random.default_rng(5)
    rows, cols = 48, 256
    w, _ = random_weights(rng, qt, rows, cols)
    bias = rng.standard_normal(rows).astype(np.float32)
    lin = Linear(w.copy(), qt, rows, cols, bias, act_q8=True)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    want = [lin(x[:n]) for n in (1, 2, 5)]
    assert lin.pack_x16() == ops.x16_fast()
    if lin.x16:
        assert lin.w.__array_interface__["data"][0] % ops.HUGE_PAGE == 0  # its own mapping
        np.testing.assert_array_equal(lin.w, numpy_x16(w, qt, cols))
        assert not lin.pack_x16()  # once
    for n, y in zip((1, 2, 5), want, strict=True):
        np.testing.assert_array_equal(lin(x[:n]), y)
    f32 = Linear(w.copy(), qt, rows, cols, None, act_q8=False)
    assert not f32.pack_x16() and not f32.x16  # f32 activations keep GGML rows


@pytest.mark.parametrize(
    "qt,biases", [(ops.QType.Q4_0, False), (ops.QType.Q8_0, True), (ops.QType.MXFP4, True)]
)
def test_expert_ffn_group_x16_bit_equal(isa, qt, biases):
    """Records whose gate, up and down are X16-packed (Model.x16_record) give
    expert_ffn_group's bits on the GGML records: experts of 1 to 17 rows (the packed tile
    kernel, and the GEMMs past 8), 1 and 2 threads."""
    from tests.test_expert_group import _records

    rng = np.random.default_rng(21)
    d_model, d_ff = 128, 192
    qts = (qt,) * 3
    counts = [1, 3, 0, 17, 2, 9]
    records, spans, _ = _records(rng, qts, d_model, d_ff, len(counts), biases)
    packed = [r.copy() for r in records]
    for rec in packed:
        for name, rows, cols in (("gate", d_ff, d_model), ("up", d_ff, d_model),
                                 ("down", d_model, d_ff)):  # fmt: skip
            o, nb = spans[name]
            v = rec[o : o + nb].reshape(rows, -1)
            np.testing.assert_array_equal(ops.pack_x16(v, qt, cols, out=v), v)
    n = sum(counts)
    x = rng.standard_normal((n, d_model)).astype(np.float32)
    rw = rng.uniform(0.1, 1, n).astype(np.float32)
    row_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    for t in (1, 2):
        args = (spans, qts, row_off, d_model, d_ff)
        want = ops.expert_ffn_group(np.empty((n, d_model), np.float32), x, records, *args,
                                    row_weight=rw, act_q8=True, nthreads=t)  # fmt: skip
        got = ops.expert_ffn_group(np.full((n, d_model), np.nan, np.float32), x, packed, *args,
                                   row_weight=rw, act_q8=True, nthreads=t, x16=True)  # fmt: skip
        np.testing.assert_array_equal(got, want)
    with pytest.raises(KernelError):  # x16 needs Q8_0 activations
        ops.expert_ffn_group(np.empty((n, d_model), np.float32), x, packed, *args, x16=True)


@pytest.mark.parametrize("qt", QTYPES, ids=lambda q: q.name)
def test_expert_ffn_x16_bit_equal(qt):
    """ops.expert_ffn on X16-packed gate, up, down (the model's dense MLPs and shared experts)
    gives its bits on GGML rows, 1 to 17 token rows, 1 and 2 threads; x16 is refused without
    Q8_0 activations or for mixed types."""
    rng = np.random.default_rng(8)
    d_model, d_ff = 128, 192
    g, u = (random_weights(rng, qt, d_ff, d_model)[0] for _ in range(2))
    d, _ = random_weights(rng, qt, d_model, d_ff)
    pg, pu, pd = (ops.pack_x16(w, qt, c) for w, c in ((g, d_model), (u, d_model), (d, d_ff)))
    x = rng.standard_normal((17, d_model)).astype(np.float32)
    rw = rng.uniform(0.1, 1, 17).astype(np.float32)
    for n in (1, 2, 3, 8, 9, 17):
        for t in (1, 2):
            kw = dict(row_weight=rw[:n], accumulate=False, act_q8=True, nthreads=t)
            want = ops.expert_ffn(np.empty((n, d_model), np.float32), x[:n], g, u, d, qt,
                                  d_model, d_ff, **kw)  # fmt: skip
            got = ops.expert_ffn(np.full((n, d_model), np.nan, np.float32), x[:n], pg, pu, pd,
                                 qt, d_model, d_ff, x16=True, **kw)  # fmt: skip
            np.testing.assert_array_equal(got, want, err_msg=f"n={n} t={t}")
    y = np.empty((1, d_model), np.float32)
    with pytest.raises(KernelError):
        ops.expert_ffn(y, x[:1], pg, pu, pd, qt, d_model, d_ff, x16=True)  # f32 activations
    with pytest.raises(KernelError):
        ops.expert_ffn(y, x[:1], pg, pu, pd, qt, d_model, d_ff, act_q8=True, x16=True,
                       qtypes=(qt, qt, qt))  # fmt: skip


@pytest.mark.parametrize(
    "case,quant",
    [("mixtral", "q4_0"), ("mixtral", "q8_0"), ("mixtral", "mxfp4"), ("qwen2_moe", "q8_0")],
)
async def test_engine_resident_experts_packed_same_logits(tmp_path, monkeypatch, case, quant):
    """A tiny Mixtral (and Qwen2-MoE, with shared experts) whose shapes have the X16 layout:
    with every record resident the engine packs its experts, LM head, attention projections
    and shared experts where the CPU has the kernels, and
    its logits over a prefill and 12 greedy steps are the bits of the same engine with packing
    off (ops.x16_fast False: GGML rows everywhere), with every record resident (the steps
    after all are read run in one trip: Pipeline.resident) or a cache of one layer's top-k
    (records evicted and re-read, a trip per layer)."""
    from colibri.convert import convert
    from colibri.engine import open_engine
    from colibri.io.format import open_store
    from tests import hf_models

    sizes = {"mixtral": dict(intermediate_size=128),  # qwen2_moe: a shared expert too
             "qwen2_moe": dict(shared_expert_intermediate_size=128)}  # fmt: skip
    model = hf_models.build(case, seed=4, **sizes[case])
    src = hf_models.save(model, tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant=quant, dense_quant="q8_0")
    s = open_store(store)
    record, k = s.layout.record_nbytes, s.config["num_experts_per_tok"]
    ids = list(range(3, 40))

    async def run(budget: int) -> tuple[bool, bool, np.ndarray]:
        async with open_engine(store, budget=budget, activations="q8_0") as eng:
            last = max(r.layer for r in s.records)  # routes the prompt's last token only
            for r in s.records[::2] + [r for r in s.records[1::2] if r.layer == last]:
                (await eng.cache.get(r.layer, r.expert)).release()  # half the rest before
            seq = eng.new_sequence()
            out = [await eng.forward(seq, ids)]
            for _ in range(12):
                out.append(await eng.forward(seq, [int(np.argmax(out[-1]))]))
            # every record fits: once all were read the steps run in one trip each
            resident = eng.pipeline.times.resident_steps
            assert (resident > 0) == (budget == everything), resident
            m = eng.model
            if m.x16_experts:  # Model.expert_ffn (one expert, e.g. cluster owners) on packed
                r = s.records[-1]  # records: the bits of the GGML record
                lease = await eng.cache.get(r.layer, r.expert)
                rows = np.array([0, 2, 3])
                h = np.random.default_rng(1).standard_normal((4, m.spec.d_model), np.float32)
                wts = np.array([0.5, 0.25, 1.0], np.float32)
                got1 = m.expert_ffn(lease.buffer, h, rows, wts, layer=r.layer)
                plain = lease.buffer.copy()
                for name, qt, nr, cols in m._x16_shapes(r.layer):
                    o, nb = m._experts.get(r.layer, m._experts[None])[0][name]
                    v = plain[o : o + nb].reshape(nr, -1)
                    ops.unpack_x16(v, qt, cols, out=v)
                lease.release()
                m.x16_experts = False
                np.testing.assert_array_equal(got1, m.expert_ffn(plain, h, rows, wts, r.layer))
                m.x16_experts = True
            shared = [w["shared"] for w in eng.model.layers if "shared" in w]
            assert bool(shared) == (case == "qwen2_moe")
            assert all(lin.x16 == eng.model.lm_head.x16 for lins in shared for lin in lins)
            return eng.model.x16_experts, eng.model.lm_head.x16, np.stack(out)

    everything = len(s.records) * record
    x16_experts, x16_head, got = await run(everything)
    assert x16_experts == x16_head == ops.x16_fast()
    assert not (await run(k * record))[0]  # evicting cache: experts stay GGML rows
    monkeypatch.setattr(ops, "x16_fast", lambda: False)
    for budget in (everything, k * record):
        x16_experts, x16_head, want = await run(budget)
        assert not x16_experts and not x16_head
        np.testing.assert_array_equal(got, want)
