"""Continuous batching (colibri/scheduler.py, Pipeline.forward_batch) on the demo model:
concurrent streams give exactly their solo tokens and logprobs (greedy and seeded sampling,
prompts longer than a prefill chunk joining mid-stream), share expert lookups, and a stream
that is abandoned leaves no sequence, lease or read behind."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from colibri.compute import ops
from colibri.compute.ops import QType
from colibri.engine import open_engine
from tests.serve_util import DEMO

PROMPTS = ["The for statement", "A while loop", "def main():", "import numpy as np"]


async def _run(engine, prompt, **kw):
    items = [t async for t in engine.stream(prompt, **kw)]
    return [(t.token_id, t.logprob, t.text) for t in items], items[-1]


@pytest.mark.parametrize(
    ("activations", "batch"), [("q8_0", "split"), ("f32", "split"), ("q8_0", "fused")]
)
async def test_concurrent_streams_equal_solo_runs(activations, batch):
    long_prompt = list(range(5, 5 + 600))  # three prefill chunks of 256
    reqs = [
        (PROMPTS[0], dict(max_tokens=24, temperature=0)),
        (PROMPTS[1], dict(max_tokens=24, temperature=0.9, seed=3, top_p=0.9)),
        (PROMPTS[2], dict(max_tokens=24, temperature=1.2, seed=11, logprobs=3)),
        (long_prompt, dict(max_tokens=12, temperature=0)),
        (PROMPTS[3], dict(max_tokens=24, temperature=0, ignore_eos=True)),
    ]
    opts = dict(io="threads", activations=activations, max_running=8, batch=batch)
    async with open_engine(DEMO, **opts) as eng:
        solo, solo_steps, solo_gets = [], 0, 0
        for prompt, kw in reqs:
            s0 = eng.statistics()
            solo.append((await _run(eng, prompt, **kw))[0])
            d = eng.statistics().delta(s0)
            solo_steps += d.forward_steps
            solo_gets += d.expert_hits + d.expert_misses
        s0 = eng.statistics()

        async def late(prompt, kw, delay):
            await asyncio.sleep(delay)  # joins while the others decode
            return (await _run(eng, prompt, **kw))[0]

        together = await asyncio.gather(
            *(late(p, kw, 0.0 if i < 3 else 0.02 * i) for i, (p, kw) in enumerate(reqs))
        )
        d = eng.statistics().delta(s0)
        assert together == solo  # ids, logprobs and text, bit for bit
        assert d.forward_steps < solo_steps  # they really ran in shared steps
        assert d.expert_hits + d.expert_misses < solo_gets  # one lookup per expert per step
        st = eng.statistics()
        assert st.running == st.waiting == st.leased == 0


KERNEL_CASES = [(q, False) for q in (QType.F32, QType.F16, QType.BF16, QType.Q4_0, QType.Q8_0)]
KERNEL_CASES += [(QType.Q4_0, True), (QType.Q8_0, True)]  # Q8_0 activations: these two only


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize(("qtype", "act_q8"), KERNEL_CASES)
def test_kernel_rows_do_not_depend_on_the_row_count(isa, qtype, act_q8):
    """Every matmul computes a row alike whatever the number of rows in its call: the
    f32-activation SIMD matmuls tile x rows in groups of 4, 2 and 1 with one accumulation
    order for all three (csrc/arch/matmul_simd.inc mm_dot; AVX2 once differed unless the call
    had a multiple of 4 rows, the reason "fused" batches pad those calls to 4), and the Q8_0-
    activation kernels compute every row alike (tests/test_batch_invariance.py)."""
    if ops.ISA[isa.upper()] > ops.best_isa():
        pytest.skip(f"{isa} not available here")
    before = ops.isa()
    ops.set_isa(isa)
    try:
        rng = np.random.default_rng(0)
        w = rng.standard_normal((96, 256)).astype(np.float32)
        w = w if qtype == QType.F32 else ops.quantize(w, qtype)
        x = rng.standard_normal((24, 256)).astype(np.float32)

        def mm(rows):
            out = np.empty((len(rows), 96), np.float32)
            if act_q8:
                return ops.matmul_q8(w, qtype, ops.quantize_act(rows), out)
            return ops.matmul(w, qtype, rows, out)

        full = mm(x)
        for n in (4, 8, 12, 20):
            for start in (0, 1, 3):
                assert np.array_equal(mm(x[start : start + n]), full[start : start + n])
        unpadded = [n for n in (1, 2, 3, 5, 6, 7) if not np.array_equal(mm(x[:n]), full[:n])]
        assert not unpadded
    finally:
        ops.set_isa(before)


async def test_abandoned_and_waiting_streams_leave_nothing_behind():
    async with open_engine(DEMO, io="threads", max_running=1) as eng:
        first = eng.stream(PROMPTS[0], max_tokens=500, ignore_eos=True, temperature=0)
        second = eng.stream(PROMPTS[1], max_tokens=500, ignore_eos=True, temperature=0)
        await first.__anext__()
        task = asyncio.ensure_future(second.__anext__())  # waits: max_running=1
        await asyncio.sleep(0.05)
        assert eng.statistics().waiting == 1 and eng.statistics().running == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await second.aclose()
        await first.aclose()
        for _ in range(100):
            st = eng.statistics()
            if st.running == st.waiting == st.leased == st.reads_in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert st.running == st.waiting == st.leased == st.reads_in_flight == 0
        steps = st.forward_steps
        await asyncio.sleep(0.1)
        assert eng.statistics().forward_steps == steps  # nothing runs any more
        # and the engine still serves
        out = await eng.generate(PROMPTS[0], max_tokens=3, temperature=0)
        assert isinstance(out, str)


async def test_a_forward_cancelled_as_its_misses_start_holds_no_lease(monkeypatch):
    """A cancellation that lands in the loop iterations a MoE layer yields right after
    starting its misses' reads (the stream closed at that moment) releases the hits' leases
    and cancels the reads: none stays leased (it was a rare leak of top-k leases)."""
    import sys

    real_sleep = asyncio.sleep
    cancelled = []

    async def sleep(delay, *args, **kw):
        if delay == 0 and sys._getframe(1).f_code.co_name == "_moe" and not cancelled:
            cancelled.append(1)
            raise asyncio.CancelledError
        return await real_sleep(delay, *args, **kw)

    async with open_engine(DEMO, io="threads", budget=8 * 196608, prefetch=False) as eng:
        monkeypatch.setattr(asyncio, "sleep", sleep)
        with pytest.raises(asyncio.CancelledError):
            await eng.pipeline.forward(list(range(5, 40)), eng.new_sequence().kv)
        monkeypatch.setattr(asyncio, "sleep", real_sleep)
        assert cancelled  # the cancellation landed there
        for _ in range(200):
            st = eng.statistics()
            if st.reads_in_flight == 0 and st.leased == 0:
                break
            await asyncio.sleep(0.01)
        assert st.reads_in_flight == 0 and st.leased == 0, st
        assert isinstance(await eng.generate(PROMPTS[0], max_tokens=3, temperature=0), str)


async def test_closing_the_engine_cancels_running_streams():
    async with open_engine(DEMO, io="threads") as eng:
        agen = eng.stream(PROMPTS[0], max_tokens=800, ignore_eos=True, temperature=0)
        await agen.__anext__()
        closing = asyncio.ensure_future(eng.aclose())
        items = [t async for t in agen]
        await closing
    assert items[-1].finish_reason == "cancelled"


@pytest.mark.parametrize("batch", ["split", "fused"])
async def test_prefix_cache_reuses_a_shared_prompt_prefix(batch):
    rng = np.random.default_rng(5)
    prefix = rng.integers(5, 2000, size=1000).tolist()
    a, b = [*prefix, 7, 8, 9], [*prefix, 10, 11, 12, 13]
    async with open_engine(DEMO, io="threads", batch=batch) as cold:
        expected = (await _run(cold, b, max_tokens=8, temperature=0))[0]
    async with open_engine(DEMO, io="threads", prefix_cache=64 << 20, batch=batch) as eng:
        first = (await _run(eng, a, max_tokens=8, temperature=0))[1].statistics
        assert first.prefix_tokens == 0
        s0 = eng.statistics()
        got, last = await _run(eng, b, max_tokens=8, temperature=0)
        d = eng.statistics().delta(s0)
        assert last.statistics.prefix_tokens == 992 == d.prefix_hits  # 62 blocks of 16
        assert got == expected
        assert 0 < eng.statistics().prefix_nbytes <= 64 << 20
        # a prompt that is all prefix still computes its last token
        again = (await _run(eng, a, max_tokens=8, temperature=0))[1].statistics
        assert again.prefix_tokens == 1000 // 16 * 16


def test_prefix_cache_budget_evicts_oldest_blocks():
    from types import SimpleNamespace

    from colibri.engine import EngineOptions
    from colibri.errors import ColibriError
    from colibri.model import KVCache
    from colibri.prefix_cache import PrefixCache

    attention = SimpleNamespace(mla=None, indexer=None, n_kv_heads=1, head_dim=4, v_head_dim=4)
    Spec = SimpleNamespace(
        layers=[SimpleNamespace(attention=attention, linear_attn=None)]
    )  # what allocate reads
    kv = KVCache.allocate(Spec, 64)
    kv.k[0][:] = np.arange(64 * 4, dtype=np.float32).reshape(64, 1, 4)
    kv.v[0][:] = -kv.k[0]
    kv.length = 64
    block_nbytes = 2 * 16 * 4 * 4
    pc = PrefixCache(3 * block_nbytes, block_size=16)
    ids = list(range(64))
    pc.store(ids, kv)
    assert pc.nbytes == 3 * block_nbytes  # four blocks, budget of three: the first evicted
    fresh = KVCache.allocate(Spec, 64)
    assert pc.lookup(ids, fresh) == 0  # block 0 is gone, so no prefix matches
    pc2 = PrefixCache(10 * block_nbytes, block_size=16)
    pc2.store(ids, kv)
    fresh = KVCache.allocate(Spec, 64)
    assert pc2.lookup([*ids[:40], 99, 98], fresh) == 32
    np.testing.assert_array_equal(fresh.k[0][:32], kv.k[0][:32])
    np.testing.assert_array_equal(fresh.v[0][:32], kv.v[0][:32])
    assert not fresh.k[0][32:].any()
    with pytest.raises(ColibriError, match="prefix_cache"):
        EngineOptions(prefix_cache=-1)
    with pytest.raises(ColibriError, match="max_running"):
        EngineOptions(max_running=0)
    with pytest.raises(ColibriError, match="batch"):
        EngineOptions(batch="stacked")
    with pytest.raises(ColibriError, match="verify"):
        EngineOptions(verify="always")


async def test_expert_aware_admission_keeps_the_working_set_in_the_cache():
    from colibri.io.format import open_store

    rec = open_store(DEMO).layout.record_nbytes
    # 10 slots for 32 experts; one sequence asks top-2 x 4 layers = 8 records a step
    async with open_engine(DEMO, io="threads", budget=10 * rec, max_running=8) as eng:
        assert eng.scheduler.capacity() == 1
        solo = [(await _run(eng, p, max_tokens=12, temperature=0))[0] for p in PROMPTS[:3]]
        seen = []

        async def watch():
            while True:
                st = eng.statistics(components=False)
                seen.append((st.running, st.waiting))
                await asyncio.sleep(0.002)

        w = asyncio.ensure_future(watch())
        together = await asyncio.gather(
            *(_run(eng, p, max_tokens=12, temperature=0) for p in PROMPTS[:3])
        )
        w.cancel()
        assert [t[0] for t in together] == solo
        assert max(r for r, _ in seen) == 1 and max(q for _, q in seen) >= 1
    async with open_engine(DEMO, io="threads", max_running=8) as eng:  # every expert fits
        assert eng.scheduler.capacity() == 8


@pytest.mark.parametrize("verify", ["once", True, False])
async def test_verify_hashes_a_record_on_its_first_read_or_on_every_read(verify, monkeypatch):
    """A small budget re-reads evicted records: verify="once" (the default) hashes each record
    the first time only, True every read, False never (counted at Store.verify_record)."""
    from colibri.io.format import Store, open_store

    checked = []
    real = Store.verify_record
    monkeypatch.setattr(
        Store,
        "verify_record",
        lambda self, r, b: (checked.append((r.layer, r.expert)), real(self, r, b)),
    )
    rec = open_store(DEMO).layout.record_nbytes
    opts = {} if verify == "once" else {"verify": verify}
    async with open_engine(DEMO, io="threads", budget=10 * rec, prefetch=False, **opts) as eng:
        await _run(eng, PROMPTS[0], max_tokens=12, temperature=0)
        reads = eng.statistics(components=False).reads
    assert reads > len(set(checked)) > 0 or verify is False
    want = {"once": len(set(checked)), True: reads, False: 0}[verify]
    assert len(checked) == want
    if verify == "once":
        assert len(checked) == len(set(checked)) < reads


@pytest.mark.parametrize("batch", ["split", "fused"])
async def test_a_forward_with_every_record_resident_is_one_compute_trip_per_moe_layer(batch):
    """The first trip embeds and routes the first MoE layer, each MoE layer's expert trip goes
    on with the next layer's attention and routing, the last one with the logits: L + 1 trips
    to the compute thread for L MoE layers once every record is resident, for one sequence
    and for a batch of two; the logits are those of the solo forward passes, bit for bit."""
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    async with open_engine(DEMO, io="threads", batch=batch) as eng:
        pipe = eng.pipeline
        moe = sum(1 for s in eng.spec.layers if s.moe)
        solo = [await eng.forward(eng.new_sequence(), t) for t in ids]  # loads their experts
        trips, run = 0, pipe._run

        async def counted(fn, *args):
            nonlocal trips
            trips += 1
            return await run(fn, *args)

        pipe._run = counted
        s0 = eng.cache.statistics()
        one = await pipe.forward(np.array(ids[0]), eng.new_sequence().kv)
        assert (trips, eng.cache.statistics().misses - s0.misses) == (moe + 1, 0)
        trips = 0
        kvs = [eng.new_sequence().kv for _ in ids]
        both = await pipe.forward_batch([(np.array(t), kv) for t, kv in zip(ids, kvs, strict=True)])
        assert (trips, eng.cache.statistics().misses - s0.misses) == (moe + 1, 0)
        np.testing.assert_array_equal(one, solo[0])
        for got, want in zip(both, solo, strict=True):
            np.testing.assert_array_equal(got, want)
