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


@pytest.mark.parametrize("activations", ["q8_0", "f32"])
async def test_concurrent_streams_equal_solo_runs(activations):
    long_prompt = list(range(5, 5 + 600))  # three prefill chunks of 256
    reqs = [
        (PROMPTS[0], dict(max_tokens=24, temperature=0)),
        (PROMPTS[1], dict(max_tokens=24, temperature=0.9, seed=3, top_p=0.9)),
        (PROMPTS[2], dict(max_tokens=24, temperature=1.2, seed=11, logprobs=3)),
        (long_prompt, dict(max_tokens=12, temperature=0)),
        (PROMPTS[3], dict(max_tokens=24, temperature=0, ignore_eos=True)),
    ]
    async with open_engine(DEMO, io="threads", activations=activations, max_running=8) as eng:
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


def test_kernels_are_not_batch_invariant_so_the_pipeline_splits_by_sequence():
    """Why Pipeline.forward_batch makes one kernel call per sequence: the SIMD Q4_0 matmul
    blocks rows differently for 1, 2 and 4 rows, so a row's result depends on its batch.
    (If this starts failing, the kernels became invariant and rows could be stacked.)"""
    if ops.best_isa() == ops.ISA.SCALAR:
        pytest.skip("the scalar kernels are row-invariant")
    rng = np.random.default_rng(0)
    w = ops.quantize(rng.standard_normal((64, 256)).astype(np.float32), QType.Q4_0)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    together = ops.matmul_q8(w, QType.Q4_0, ops.quantize_act(x), np.empty((3, 64), np.float32))
    alone = ops.matmul_q8(w, QType.Q4_0, ops.quantize_act(x[:1]), np.empty((1, 64), np.float32))
    assert not np.array_equal(together[:1], alone)
    np.testing.assert_allclose(together[:1], alone, rtol=1e-4, atol=1e-4)


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


async def test_closing_the_engine_cancels_running_streams():
    async with open_engine(DEMO, io="threads") as eng:
        agen = eng.stream(PROMPTS[0], max_tokens=800, ignore_eos=True, temperature=0)
        await agen.__anext__()
        closing = asyncio.ensure_future(eng.aclose())
        items = [t async for t in agen]
        await closing
    assert items[-1].finish_reason == "cancelled"
