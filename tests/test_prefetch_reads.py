"""Prefetch at the storage-bound point, through the real engine: with a budget far below one
token's experts every layer misses, and then each expert record must be read once a token and
no demand miss may wait for a slot a prefetch took. (A prefetch issued in the same event-loop
iteration as a layer's request used to take the slots its misses needed: every layer was read
twice and every prefetch wasted.) Also the same greedy tokens as with prefetch off."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from colibri.convert import convert
from colibri.engine import open_engine
from colibri.io.format import open_store
from tests import hf_models

NEW_TOKENS = 10


class _LoggingReader:
    """The engine's reader, with each read's ("read", (layer, expert)) appended to `log`."""

    def __init__(self, reader, log: list) -> None:
        self._reader, self._log = reader, log

    def __getattr__(self, name):
        return getattr(self._reader, name)

    async def read_into(self, record, slot, *, priority=0):
        # logged once read: a prefetch cancelled while queued behind demand reads never reads
        await self._reader.read_into(record, slot, priority=priority)
        self._log.append(("read", (record.layer, record.expert)))


async def _decode(store, ids, prefetch: bool, budget: int):
    """Greedy tokens, the decode's log of reads and demands, and per decode token the
    cache statistics' reads started (done or in flight) and slot waits."""
    async with open_engine(store, budget=budget, prefetch=prefetch, threads=1) as engine:
        log: list = []
        cache = engine.cache
        cache.reader = _LoggingReader(cache.reader, log)
        get = cache.get

        async def logged_get(layer, expert):
            lease = await get(layer, expert)
            log.append(("get", (layer, expert)))  # when the record is there for its use
            return lease

        cache.get = logged_get  # the pipeline's demands
        seq = engine.new_sequence()
        logits = await engine.forward(seq, ids)
        start, out, per_token = len(log), [], []
        for _ in range(NEW_TOKENS):
            out.append(int(np.argmax(logits)))
            st0 = cache.statistics()
            logits = await engine.forward(seq, [out[-1]])
            st = cache.statistics()
            started = st.reads + st.reads_in_flight - st0.reads - st0.reads_in_flight
            per_token.append((started, st.slot_waits - st0.slot_waits))
        for _ in range(1000):  # the guesses still in flight land (and are logged)
            if not cache.counts()["reads_in_flight"]:
                break
            await asyncio.sleep(0.01)
        issued = cache.statistics().prefetch_issued
    return out, log[start:], per_token, issued


@pytest.mark.parametrize("spare", [0, 1])
async def test_storage_bound_decode_reads_each_record_once_a_token(tmp_path, spare):
    """spare: one layer's top-k of slots beside the demands' (0: none, every layer misses
    and no prefetch can start without taking a demand's slot; 1: prefetches run)."""
    case = "mixtral"
    src = hf_models.save(hf_models.build(case, seed=7), tmp_path / "hf")
    store = tmp_path / "store"
    convert(src, store, quant="q4_0", dense_quant="q8_0")
    s = open_store(store)
    k, record = s.config["num_experts_per_tok"], s.layout.record_nbytes
    layers = len({r.layer for r in s.records})
    assert layers >= 3
    budget = (1 + spare) * k * record
    ids = list(range(3, 19))
    reference, _, _, _ = await _decode(store, ids, prefetch=False, budget=budget)
    tokens, log, per_token, issued = await _decode(store, ids, prefetch=True, budget=budget)
    assert tokens == reference
    # each record at most once a token: between two visits of its layer (the demands there)
    # no record of that layer is read twice. The bug: a record prefetched for layer L, its
    # slot taken back before layer L's demand, read again by that demand
    since: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for n, (what, (layer, expert)) in enumerate(log):
        if what == "get":
            since[layer].clear()
            continue
        since[layer][expert] += 1
        assert since[layer][expert] == 1, f"{(layer, expert)} read twice for one use: {log[:n]}"
    gets = sum(1 for what, _ in log if what == "get")
    assert gets == NEW_TOKENS * layers * k
    reads = sum(r for r, _ in per_token)
    assert reads == sum(1 for what, _ in log if what == "read")
    if spare:
        assert issued > 0  # the prefetcher really read ahead
    else:  # every layer missed: the reads (statistics) are the demands, each once
        assert reads == gets
    waits = [w for _, w in per_token]
    assert not any(waits), f"demand misses waited for a prefetch's slot: {waits}"
