"""The last layer runs only the rows whose logits are wanted (Pipeline._kept_rows,
Model.attention_rows), as llama.cpp's inp_out_ids: every row's keys, values and state, but the
attention output, the FFN (and so the routed experts' reads) and the head of the kept rows
only. Every family's every test case (Family.test_configs), Q8_0 storage with Q8_0 and f32
activations (row-invariant kernels): the logits, the log-probabilities of scored targets and
every array of the KV cache are the bits of a forward that computes every row, in split and
fused batches; the last MoE layer routes and requests the experts of the kept rows only, a
dense last layer runs its MLP on them only."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.convert import convert
from colibri.engine import open_engine
from colibri.model import KVCache
from colibri.registry import model_spec
from tests import hf_models


def _state(kv: KVCache) -> list[np.ndarray]:
    """Every array of a KV cache that a forward writes (keys, values, recurrent and conv
    state, indexer keys, compressor entries and windows), copied."""
    arrays = [*kv.k, *kv.v, *kv.conv, *kv.recurrent, *kv.index_k, *kv.compressed]
    arrays += [*kv.compress_buf, *kv.index_buf]
    return [a.copy() for a in arrays if a is not None]


async def _run(eng, skip: bool) -> tuple[list, list, list, list, list]:
    """Feed a fixed script of forwards (a prefill for the last logits, a chunk with logits
    from row 6, a chunk with none, decode steps, a batch of three sequences with logits, no
    logits and scored targets); returns (outputs, KV states, rows routed at the last layer
    per forward, last layer's experts requested per forward, experts routed there)."""
    p = eng.pipeline
    p.skip_unused_rows = skip
    last = len(eng.spec.layers) - 1
    routed_rows: list[int] = []
    routed_ids: list[set[int]] = []
    requested: list[set[int]] = []

    def observe(layer, tokens, experts):
        if layer == last:
            assert len(tokens) == len(experts)
            routed_rows.append(len(tokens))
            routed_ids.append(set(np.unique(experts).tolist()))

    request = p.cache.request

    def count(layer, experts):
        if layer == last:
            requested.append(set(experts))
        return request(layer, experts)

    p.route_observer, p.cache.request = observe, count
    ids = [int(t) for t in np.random.default_rng(11).integers(3, 150, 64)]
    out = []
    try:
        a = eng.new_sequence()
        out.append(await eng.forward(a, ids[:24]))
        out.append(await eng.forward(a, ids[24:34], all_logits=True, logits_from=6))
        out.append(await eng.forward(a, ids[34:44], all_logits=True, logits_from=10))
        for t in ids[44:47]:
            out.append(await eng.forward(a, [t]))
        b, c, d = eng.new_sequence(), eng.new_sequence(), eng.new_sequence()
        out += await eng.forward_batch(
            [b, c, d],
            [ids[:20], ids[20:37], ids[37:64]],
            all_logits=[True, True, True],
            logits_from=[13, 17, 5],
            targets=[None, None, ids[42:64]],
        )
        out += await eng.forward_batch([a, b, c], [ids[47:48], ids[:3], ids[5:6]])
        states = [_state(s.kv) for s in (a, b, c, d)]
    finally:
        p.route_observer, p.cache.request = None, request
    return out, states, routed_rows, requested, routed_ids


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


@pytest.fixture(scope="module", params=sorted(hf_models.CASES))
def store(request, tmp_path_factory):
    """(case, the case's tiny checkpoint converted to Q8_0)."""
    root = tmp_path_factory.mktemp(request.param)
    src = hf_models.save(hf_models.build(request.param, seed=3), root / "hf")
    convert(src, root / "q8", quant="q8_0", dense_quant="q8_0")
    return request.param, root / "q8"


@pytest.mark.parametrize("activations", ["q8_0", "f32"])
@pytest.mark.parametrize("batch", ["split", "fused"])
async def test_last_layer_computes_the_wanted_rows_only(store, batch, activations):
    case, path = store
    opts = dict(io="threads", batch=batch, activations=activations)  # prefetch on
    async with open_engine(path, **opts) as eng:
        assert eng.model.ffn_rows_exact(len(eng.spec.layers) - 1), case
        full = await _run(eng, skip=False)
        kept = await _run(eng, skip=True)
        moe = model_spec(eng.store.config).layers[-1].moe
    for x, y in zip(full[0], kept[0], strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, case
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=case)
    assert [len(o) for o in kept[0][1:3]] == [4, 0]  # logits from row 6 of 10; none
    for s_full, s_kept in zip(full[1], kept[1], strict=True):
        for x, y in zip(s_full, s_kept, strict=True):
            np.testing.assert_array_equal(x, y, err_msg=case)
    if not moe:
        return
    # rows routed at the last MoE layer per forward: every row, or the kept ones (a chunk
    # without logits still runs its last row)
    assert full[2] == [24, 10, 10, 1, 1, 1, 64, 5], case
    assert kept[2] == [1, 4, 1, 1, 1, 1, 7 + 1 + 22, 3], case
    # the cache is asked for the experts of the routed rows only: fewer records
    assert kept[3] == kept[4] and full[3] == full[4], case
    assert sum(map(len, kept[3])) < sum(map(len, full[3])), case


@pytest.mark.parametrize("batch", ["split", "fused"])
async def test_a_dense_last_layer_runs_its_mlp_on_the_kept_rows(tmp_path, monkeypatch, batch):
    """Llama 4 with MoE every other layer, 3 layers: the last is a dense MLP layer."""
    from colibri import model as model_mod

    model = hf_models.build("llama4_text_interleaved_top2", seed=3, num_hidden_layers=3)
    src = hf_models.save(model, tmp_path / "hf")
    convert(src, tmp_path / "q8", quant="q8_0", dense_quant="q8_0")
    rows: list[int] = []
    dense_ffn = model_mod.Model.dense_ffn

    def spy(self, i, h, out, x=None):
        if i == len(self.spec.layers) - 1:
            rows.append(len(h))
        return dense_ffn(self, i, h, out, x)

    monkeypatch.setattr(model_mod.Model, "dense_ffn", spy)
    async with open_engine(tmp_path / "q8", io="threads", batch=batch) as eng:
        assert [layer.moe for layer in eng.spec.layers] == [False, True, False]
        full = await _run(eng, skip=False)
        n_full, rows[:] = list(rows), []
        kept = await _run(eng, skip=True)
    for x, y in zip(full[0], kept[0], strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))
    for s_full, s_kept in zip(full[1], kept[1], strict=True):
        for x, y in zip(s_full, s_kept, strict=True):
            np.testing.assert_array_equal(x, y)
    # per forward (split: per sequence where stacking is off, else the batch's rows at once)
    assert sum(n_full) == 24 + 10 + 10 + 3 + 64 + 5 and sum(rows) == 1 + 4 + 1 + 3 + 30 + 3


@pytest.mark.parametrize("quant", ["fp8", "mxfp4", "q4_0"])
async def test_other_expert_types_keep_the_bits(tmp_path, quant):
    """FP8 (f32 dots on the Q8_0 values per 128-column block), MXFP4 and Q4_0 experts and
    dense weights on Q8_0 activations: row-invariant, so the last layer keeps the kept rows
    with the bits of every row; on f32 activations FP8 and MXFP4 have no row-invariant
    path (F32_ROW_INVARIANT_QTYPES) and every row runs."""
    src = hf_models.save(hf_models.build("qwen3_moe", seed=3), tmp_path / "hf")
    convert(src, tmp_path / quant, quant=quant, dense_quant=quant)
    for activations in ("q8_0", "f32"):
        async with open_engine(tmp_path / quant, io="threads", activations=activations) as eng:
            exact = eng.model.ffn_rows_exact(len(eng.spec.layers) - 1)
            assert exact == (activations == "q8_0" or quant == "q4_0"), (quant, activations)
            full = await _run(eng, skip=False)
            kept = await _run(eng, skip=True)
        for x, y in zip(full[0], kept[0], strict=True):
            np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=f"{quant} {activations}")
        for s_full, s_kept in zip(full[1], kept[1], strict=True):
            for x, y in zip(s_full, s_kept, strict=True):
                np.testing.assert_array_equal(x, y)
        assert kept[2][0] == (1 if exact else 24)  # rows routed at the last layer, prefill
