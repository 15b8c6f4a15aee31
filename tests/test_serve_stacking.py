"""Stacked kernel calls in a batch (Pipeline.forward_batch, Model.attention_batch): where a
kernel is row-invariant (Q8_0 activations on the weight types of model.ROW_INVARIANT_QTYPES),
the rows of every sequence in the step go through one call (one pass over the weights of an
expert, a shared expert, the q/k/v/o projections, the output head), and each sequence's logits
are still bit-identical to its solo run. Models: tiny transformers checkpoints built here
(Qwen2-MoE: qkv biases, a shared expert with its f32 sigmoid gate; OLMoE: full q/k norms)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from colibri import model as model_mod
from colibri.compute import ops
from colibri.convert import convert
from colibri.engine import open_engine
from tests import hf_models

RNG_COLS = 512  # a multiple of 256: the K-quant and IQ4_XS super-blocks


@pytest.mark.parametrize("qt", sorted(model_mod.ROW_INVARIANT_QTYPES, key=lambda q: q.name))
def test_row_invariant_types_compute_a_row_alike_in_any_call(qt):
    """Every type stacking relies on: a row's bits alone (matvec), in 2, 3, 4 and 9 rows."""
    from tests.kernel_util import random_weights

    rng = np.random.default_rng(int(qt))
    data, _ = random_weights(rng, qt, 80, RNG_COLS)
    x = (rng.standard_normal((9, RNG_COLS)) * rng.uniform(0.1, 5, (9, 1))).astype(np.float32)
    xq = ops.quantize_act(x)
    full = ops.matmul_q8(data, qt, xq, np.empty((9, 80), np.float32))
    for a, b in [(0, 1), (3, 4), (8, 9), (0, 2), (1, 4), (2, 6)]:
        part = ops.matmul_q8(data, qt, xq[a:b], np.empty((b - a, 80), np.float32))
        np.testing.assert_array_equal(part.view(np.uint32), full[a:b].view(np.uint32))


@pytest.fixture(scope="module", params=["qwen2_moe", "olmoe"])
def store(request, tmp_path_factory):
    case = request.param
    model = hf_models.build(case, seed=3)
    src = hf_models.save(model, tmp_path_factory.mktemp(f"{case}-hf"))
    return convert(src, tmp_path_factory.mktemp(case) / "store", quant="q4_0", show_progress=False)


class Calls:
    """Counts the kernel-level calls of a Model (expert FFNs, Linear calls) while active:
    "expert_ffn" counts passes over an expert's weights (one per expert of an
    expert_ffn_group call), "group" the expert_ffn_group calls."""

    def __init__(self, monkeypatch):
        self.n = collections.Counter()
        spied = [(model_mod.Model, "expert_ffn"), (model_mod.Model, "expert_ffn_group"),
                 (model_mod.Linear, "__call__")]  # fmt: skip
        for owner, name in spied:
            fn = getattr(owner, name)

            def spy(*a, _fn=fn, _name=name, **kw):
                if _name == "__call__":  # a Linear: row-invariant (stackable) or not
                    _name = "stackable" if a[0].row_invariant else "per-sequence"
                if _name == "expert_ffn_group":
                    self.n["group"] += 1
                    self.n["expert_ffn"] += len(a[1])  # a: self, records, ...
                else:
                    self.n[_name] += 1
                return _fn(*a, **kw)

            monkeypatch.setattr(owner, name, spy)


async def test_stacked_batch_equals_solo_runs_with_fewer_calls(store, monkeypatch):
    # prompt chunks of different lengths, then decode tokens
    prompts = [[5, 9, 17, 33, 2], [7, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    steps = [prompts, [[11], [12], [13]], [[20], [21], [22]]]
    # no prefetcher: its predictions (the next layer's router, per sequence) stop while it
    # backs off, which depends on timing, and would make the call counts vary
    async with open_engine(
        store, io="threads", activations="q8_0", max_running=4, prefetch=False
    ) as eng:
        pipe = eng.pipeline
        calls = Calls(monkeypatch)
        solo = []
        for s in range(len(prompts)):
            kv = eng.new_sequence().kv
            solo.append([await pipe.forward(np.asarray(st[s]), kv) for st in steps])
        solo_calls = dict(calls.n)
        calls.n.clear()
        kvs = [eng.new_sequence().kv for _ in prompts]
        together = []
        for st in steps:
            batch = [(np.asarray(t), kv) for t, kv in zip(st, kvs, strict=True)]
            together.append(await pipe.forward_batch(batch))
        for s in range(len(prompts)):
            for k in range(len(steps)):
                np.testing.assert_array_equal(
                    together[k][s].view(np.uint32), solo[s][k].view(np.uint32)
                )
        # one call per expert and step instead of one per sequence routed to it; the
        # projections and the output head once per step instead of once per sequence
        assert calls.n["expert_ffn"] < solo_calls["expert_ffn"]
        # and the ready experts of a trip in one kernel call (Model.expert_ffn_group)
        assert 0 < calls.n["group"] < solo_calls["group"]
        assert calls.n["group"] < calls.n["expert_ffn"]
        assert calls.n["stackable"] * len(prompts) == solo_calls["stackable"] > 0
        assert calls.n["per-sequence"] == solo_calls["per-sequence"]  # the f32 routers


async def test_f32_activations_keep_per_sequence_calls(store, monkeypatch):
    """f32 activations are not row-invariant: each kernel call stays one sequence's (and the
    batch still equals the solo runs)."""
    async with open_engine(store, io="threads", activations="f32", max_running=4) as eng:
        pipe = eng.pipeline
        calls = Calls(monkeypatch)
        toks = [np.asarray([5, 6, 7]), np.asarray([8, 9])]
        solo = [await pipe.forward(t, eng.new_sequence().kv) for t in toks]
        n_solo = calls.n["per-sequence"]
        calls.n.clear()
        both = await pipe.forward_batch([(t, eng.new_sequence().kv) for t in toks])
        assert calls.n["per-sequence"] == n_solo > 0 and not calls.n["stackable"]
        for a, b in zip(both, solo, strict=True):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
