"""Engine.stream(): items, finish reasons, cancellation, concurrent streams, the sync
wrapper, seeds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri import SyncEngine, open_engine
from colibri.convert import convert
from colibri.errors import ColibriError
from colibri.sampling import SamplingError
from tests import hf_models


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    hf_models.save_with_tokenizer("qwen3_moe", root / "hf", seed=4)
    convert(root / "hf", root / "store", quant="q8_0", dense_quant="q8_0")
    return root / "store"


def _leased(engine) -> int:
    return sum(e.refs for e in engine.cache._entries.values())


async def test_items_and_statistics(store):
    async with open_engine(store, io="threads") as engine:
        items = [t async for t in engine.stream("Hello there", max_tokens=6, temperature=0)]
        greedy = await _greedy_ids(engine, engine.encode_prompt("Hello there"), 6)
    last = items[-1]
    assert last.finish_reason == "length" and last.statistics is not None
    ids = [t.token_id for t in items if t.token_id is not None]
    assert ids == greedy
    assert all(t.finish_reason is None for t in items[:-1])
    st = last.statistics
    assert st.prompt_tokens == len(engine.encode_prompt("Hello there"))
    assert st.generated_tokens == 6 and st.ttft > 0 and 0 <= st.hit_rate <= 1
    text = "".join(t.text for t in items)
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


async def _greedy_ids(engine, prompt: list[int], n: int) -> list[int]:
    seq = engine.new_sequence()
    logits = await engine.forward(seq, prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = await engine.forward(seq, [out[-1]])
    return out


async def test_break_and_cancel_release_every_slot(store):
    async with open_engine(store, io="uring", budget=None) as engine:
        async for tok in engine.stream("Once upon a time", max_tokens=50):
            if tok.token_id is not None:
                break
        assert _leased(engine) == 0

        async def consume():
            async for _ in engine.stream("Once upon a time", max_tokens=500):
                await asyncio.sleep(0)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _leased(engine) == 0
        # the cancelled step's prefetches were issued, not awaited: they finish on their own
        # (bounded: a read left behind for good fails here)
        deadline = time.monotonic() + 10
        while engine.cache.statistics().reads_in_flight:
            assert time.monotonic() < deadline, engine.cache.statistics()
            await asyncio.sleep(0.01)


async def test_concurrent_streams_get_their_own_answers(store):
    prompts = ["The cat", "A quick brown fox jumps", "1 2 3 4"]
    async with open_engine(store, io="threads") as engine:
        alone = [await engine.generate(p, max_tokens=8, temperature=0) for p in prompts]
        together = await asyncio.gather(
            *(engine.generate(p, max_tokens=8, temperature=0) for p in prompts)
        )
    assert together == alone


async def test_seed_and_validation(store):
    async with open_engine(store, io="threads") as engine:
        a = await engine.generate("Hi", max_tokens=10, temperature=1.0, top_k=20, seed=7)
        b = await engine.generate("Hi", max_tokens=10, temperature=1.0, top_k=20, seed=7)
        assert a == b
        with pytest.raises(SamplingError, match="top_p"):
            await engine.generate("Hi", top_p=1.5)
        with pytest.raises(ColibriError, match="prompt too long"):
            await engine.generate(list(range(5000)))
        with pytest.raises(ColibriError, match="token id"):
            await engine.generate([60000])


def test_sync_wrapper(store):
    with SyncEngine(store, io="threads") as engine:
        text = engine.generate("Hello there", max_tokens=5, temperature=0)
        items = list(engine.stream("Hello there", max_tokens=5, temperature=0))
    assert "".join(t.text for t in items) == text
    assert items[-1].finish_reason == "length"


def test_sync_engine_left_open_is_closed_at_exit(store):
    """A script that never closes its SyncEngine (after the event loop of an asyncio.run) exits
    cleanly: no "Task was destroyed but it is pending" from the scheduler's loop."""
    script = (
        "import asyncio, colibri\n"
        "async def main():\n"
        f"    async with colibri.open_engine({str(store)!r}, io='threads') as e:\n"
        "        await e.generate('Hello', max_tokens=3)\n"
        "asyncio.run(main())\n"
        f"e = colibri.SyncEngine({str(store)!r}, io='threads')\n"
        "print(len(e.generate('Hello there', max_tokens=4, temperature=0)) >= 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    assert "Task was destroyed" not in r.stderr and "Traceback" not in r.stderr, r.stderr
