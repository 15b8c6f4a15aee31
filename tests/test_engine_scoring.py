"""The engine API colibri eval scores with: forward(all_logits, logits_from) against
transformers' logits, Sequence.truncate, and capture_routing against transformers' router
top-k (tokens whose k-th / (k+1)-th router probabilities are within 1e-4 skipped)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import ColibriError
from colibri.io.trace import RoutingTrace
from tests import hf_models

torch = hf_models.torch


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    model = hf_models.build("mixtral", seed=4)
    src = hf_models.save(model, root / "hf")
    return model, convert(src, root / "f32", quant="f32", dense_quant="f32", show_progress=False)


async def test_all_logits_and_truncate(mixtral):
    model, store = mixtral
    ids = np.random.default_rng(1).integers(0, 160, 24).tolist()
    ref = hf_models.reference_logits(model, ids)
    scale = np.abs(ref).max()
    async with open_engine(store, activations="f32") as engine:
        seq = engine.new_sequence()
        rows = await engine.forward(seq, ids, all_logits=True)
        assert rows.shape == (24, 160) and rows.dtype == np.float32
        assert np.abs(rows - ref).max() <= 1e-4 * scale
        seq.truncate(10)  # rewind, then continue with the rest: the same logits again
        assert seq.length == 10 and seq.tokens == ids[:10]
        tail = await engine.forward(seq, ids[10:], all_logits=True, logits_from=5)
        assert tail.shape == (9, 160)
        assert np.abs(tail - ref[15:]).max() <= 1e-4 * scale
        with pytest.raises(ColibriError):
            seq.truncate(30)
        with pytest.raises(ColibriError):
            await engine.forward(seq, [1, 2], all_logits=True, logits_from=3)


async def test_capture_routing_equals_transformers(mixtral, tmp_path):
    model, store = mixtral
    ids = np.random.default_rng(2).integers(0, 160, 20).tolist()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    trace_file = tmp_path / "t.npz"
    async with open_engine(store, activations="f32", trace=str(trace_file)) as engine:
        await engine.forward(engine.new_sequence(), ids[:5])  # recorded by --trace
        with engine.capture_routing() as tracer:
            seq = engine.new_sequence()
            await engine.forward(seq, ids[:12])
            await engine.forward(seq, ids[12:])
        await engine.forward(engine.new_sequence(), ids[:3])  # --trace resumes
    experts = tracer.trace().experts
    assert experts.shape == (20, len(out.router_logits), k)
    checked = 0
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(probs, k + 1, dim=-1)
        for t in range(20):
            if float(top.values[t, k - 1] - top.values[t, k]) < 1e-4:
                continue
            assert sorted(experts[t, layer]) == sorted(top.indices[t, :k].tolist()), (t, layer)
            checked += 1
    assert checked >= 50
    saved = RoutingTrace.load(trace_file)
    assert saved.num_tokens == 8  # 5 before the capture, 3 after, none of the 20 inside
    np.testing.assert_array_equal(saved.experts[:3], saved.experts[5:8])  # same 3 tokens
