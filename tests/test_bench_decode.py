"""colibri/bench/decode.py: the bounds and the per-token split, from hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from colibri.bench import decode as bd


def test_bounds_storage_compute_combined_serial() -> None:
    # 100 MB per token at 0.5 GB/s = 0.2 s; compute 0.05 s
    b = bd.bounds(100e6, 0.5, 0.05)
    assert b["t_io"] == pytest.approx(0.2)
    assert b["storage"] == pytest.approx(5.0)
    assert b["compute"] == pytest.approx(20.0)
    assert b["combined"] == pytest.approx(5.0)  # 1 / max(0.2, 0.05)
    assert b["serial"] == pytest.approx(4.0)  # 1 / (0.2 + 0.05)


def test_bounds_nothing_read_is_compute_bound() -> None:
    b = bd.bounds(0.0, 1.0, 0.1)
    assert math.isinf(b["storage"])
    assert b["combined"] == pytest.approx(10.0) and b["serial"] == pytest.approx(10.0)


def test_bounds_reject_zero_disk() -> None:
    with pytest.raises(ValueError, match="disk bandwidth"):
        bd.bounds(1.0, 0.0, 0.1)


@pytest.mark.parametrize(
    ("misses", "layers", "tokens", "cap", "qd"),
    [
        (64, 8, 1, 32, 8),
        (320, 4, 10, 32, 8),
        (30, 4, 1, 32, 8),
        (500, 4, 1, 32, 32),
        (0, 4, 8, 32, 1),
    ],
)
def test_miss_queue_depth(misses: int, layers: int, tokens: int, cap: int, qd: int) -> None:
    assert bd.miss_queue_depth(misses, layers, tokens, cap) == qd


def test_phase_per_token_split() -> None:
    p = bd.Phase(tokens=4, seconds=2.0, wait_io=0.6, compute=1.2, verify=0.1,
                 bytes_read=400, reads=4, hits=3, misses=1)  # fmt: skip
    pt = p.per_token()
    assert p.tok_s == pytest.approx(2.0) and p.hit_rate == pytest.approx(0.75)
    assert pt["total"] == pytest.approx(0.5) and pt["compute"] == pytest.approx(0.3)
    assert pt["wait_io"] == pytest.approx(0.15) and pt["other"] == pytest.approx(0.05)
    assert pt["bytes"] == pytest.approx(100)


async def test_timed_greedy_decodes_as_the_engine_generates() -> None:
    """The bench sections' shared decode loop gives the engine's own greedy tokens (generate
    at temperature 0 on the demo store), and times the steps."""
    from colibri.bench.decode import timed_greedy
    from colibri.engine import open_engine
    from colibri.run import DEMO_STORE

    async with open_engine(DEMO_STORE, io="threads") as eng:
        ids = eng.encode_prompt("The for statement")
        stream = eng.stream(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
        want = [t.token_id async for t in stream if t.token_id is not None]
        seq = eng.new_sequence()
        logits = await eng.forward(seq, ids)
        got, seconds, last = await timed_greedy(eng, seq, logits, 12)
    assert got == want and len(got) == 12
    assert seconds > 0 and last.shape == (eng.spec.vocab_size,)


def test_decode_section_store_presets(tmp_path, monkeypatch) -> None:
    """--decode-model picks the synthetic store's preset: its layers, --scale and name."""
    from colibri.bench import sec_decode
    from colibri.bench.report import Context

    ctx = Context(out=tmp_path, work=tmp_path, quick=True, threads=1, rounds=1)
    assert sec_decode.decode_model(ctx) == sec_decode.MODEL
    ctx.decode_model = "deepseek-v4-flash"
    made = []
    monkeypatch.setattr(ctx, "free_bytes", lambda: 1 << 50)
    monkeypatch.setattr(ctx, "run", lambda cmd: made.append(cmd))
    path, note = sec_decode._store(ctx, 12)
    assert path == tmp_path / "deepseek-v4-flash-L4-s0.125-q4_0" and not note
    cmd = made[0]
    assert cmd[2:4] == ["deepseek-v4-flash", str(path)]
    assert cmd[cmd.index("--scale") + 1] == "0.125" and cmd[cmd.index("--layers") + 1] == "4"
    monkeypatch.setattr(ctx, "free_bytes", lambda: 1 << 30)
    path, note = sec_decode._store(ctx, 12)
    assert path is None and "deepseek-v4-flash" in note


def test_best_disk_takes_the_faster_of_fio_and_the_reader() -> None:
    from colibri.bench.sec_limits import best_disk

    assert best_disk([1.0, 3.0, 2.0], [2.5, 2.4, 2.6]) == (2.5, "colibri's reader")
    assert best_disk([1.0, 3.0, 2.0], [1.5]) == (2.0, "fio")
    assert best_disk([1.2], []) == (1.2, "fio")
    with pytest.raises(ValueError, match="no disk runs"):
        best_disk([], [])


def test_decode_section_bound_is_not_below_the_readers_rate(tmp_path, monkeypatch) -> None:
    """When colibri's own reader reads the store faster than fio (fio 0.5 GB/s, reader 2 GB/s
    here), the storage bound divides by the reader's rate, says so, and a run that reads at
    1 GB/s is below 100% of it; the tok/s ceiling 1/max(t_io, t_c) is not called a lower bound."""
    from colibri.bench import sec_decode, sec_limits
    from colibri.bench.report import Context
    from colibri.run import DEMO_STORE

    ctx = Context(out=tmp_path, work=tmp_path, quick=True, threads=1, rounds=1)
    monkeypatch.setattr(sec_decode, "_store", lambda ctx, layers: (DEMO_STORE, ""))
    monkeypatch.setattr(sec_limits, "fio_gbps", lambda *a, **k: 0.5)
    monkeypatch.setattr(sec_limits, "reader_gbps", lambda *a, **k: 2.0)
    per_token = 10 << 20  # bytes read per decode token, at 1 GB/s: 10.5 ms

    def phase(tokens: int) -> bd.Phase:
        read = per_token * tokens
        return bd.Phase(tokens, read / 1e9, read / 1e9, 1e-3 * tokens, 0.0, read, 1, 1, 1)

    async def run_passes(path, budget, n_prompt, n_tokens, passes=2, **opts):
        return [
            bd.DecodeFigures("uring", budget, i > 0, phase(n_prompt), phase(n_tokens), None)
            for i in range(passes)
        ]

    monkeypatch.setattr(sec_decode.bench_decode, "run_passes", run_passes)
    sec = sec_decode.run(ctx)
    d = sec.data
    assert d["disk_gbps"]["decode"] == 2.0 and d["disk_source"] == "colibri's reader"
    point = d["points"]["fits"]["warm"]["decode"]
    assert point["bounds"]["storage"] == pytest.approx(2e9 / per_token)
    assert point["of_storage"] == pytest.approx(0.5)
    assert "lower bound" not in sec.markdown
    assert "colibri's reader" in sec.markdown and "of bound" in sec.markdown
