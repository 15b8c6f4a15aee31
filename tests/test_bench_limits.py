"""colibri.bench.sec_limits lookups: interpolation in queue depth, nearest record size, big-record
mapping and the cached-figure path of disk_gbps / memory_gbps (no disk or timing involved)."""

import math
from pathlib import Path

import pytest

from colibri.bench import sec_limits as lim
from colibri.bench.report import Context
from colibri.io.format import ExpertLayout, row_nbytes


def test_qwen3_record_size_is_gate_up_down_padded():
    d_model, d_ff = 2048, 768  # Qwen3-30B-A3B hidden_size, moe_intermediate_size
    raw = 2 * d_ff * row_nbytes("q4_0", d_model) + d_model * row_nbytes("q4_0", d_ff)
    assert raw == 3 * d_model * d_ff // 32 * 18
    assert lim.QWEN3_RECORD_NBYTES == math.ceil(raw / 4096) * 4096 == 2654208
    assert ExpertLayout.build("q4_0", 4096, 14336).record_nbytes > lim.CHUNK_NBYTES


def test_interpolate_qd_linear_in_log2_and_clamped():
    pts = {1: 0.5, 4: 1.5, 16: 2.0}
    assert lim.interpolate_qd(pts, 4) == 1.5
    assert lim.interpolate_qd(pts, 2) == pytest.approx(1.0)  # halfway in log2 between 1 and 4
    assert lim.interpolate_qd(pts, 8) == pytest.approx(1.75)
    assert lim.interpolate_qd(pts, 64) == 2.0 and lim.interpolate_qd(pts, 1) == 0.5
    with pytest.raises(ValueError):
        lim.interpolate_qd({}, 4)


def test_nearest_record_within_2x_else_none():
    disk = [{"record_nbytes": 1 << 20, "qd": 1, "gbps": 1.0},
            {"record_nbytes": 4 << 20, "qd": 1, "gbps": 2.0}]  # fmt: skip
    assert lim.nearest_record(disk, 3 << 20) == 4 << 20
    assert lim.nearest_record(disk, 1_500_000) == 1 << 20
    assert lim.nearest_record(disk, 100 << 10) is None  # 10x smaller than anything measured
    assert lim.nearest_record([], 1 << 20) is None


def test_lookup_point_keeps_bytes_in_flight_for_big_records():
    assert lim.lookup_point(2 << 20, 8) == (2 << 20, 8)
    mixtral = ExpertLayout.build("q4_0", 4096, 14336).record_nbytes  # 94.5 MiB
    assert lim.lookup_point(mixtral, 1) == (lim.CHUNK_NBYTES, 24)  # ceil(94.5 / 4) chunks
    assert lim.lookup_point(mixtral, 4) == (lim.CHUNK_NBYTES, 64)  # capped at the sweep's end


def test_disk_and_memory_from_the_limits_results(tmp_path: Path):
    ctx = Context(out=tmp_path, work=tmp_path, quick=True, threads=2, rounds=1)
    ctx.results["limits"] = {
        "mem_gbps": 12.0,
        "mem_gbps_1t": 8.0,
        "disk": [
            {"record_nbytes": lim.CHUNK_NBYTES, "qd": q, "gbps": g}
            for q, g in ((1, 0.4), (8, 1.6), (32, 2.4))
        ],
    }
    assert lim.memory_gbps(ctx) == 12.0
    assert lim.disk_gbps(ctx, lim.CHUNK_NBYTES, 16) == pytest.approx(2.0)
    assert lim.disk_gbps(ctx, 3 << 20, 1) == 0.4  # nearest size: the 4 MiB sweep
    # a 94.5 MiB record at QD 1 = 24 chunks in flight: between QD 8 and 32
    want = 1.6 + (math.log2(24) - 3) / 2 * 0.8
    assert lim.disk_gbps(ctx, 99090432, 1) == pytest.approx(want)
    assert ctx.commands == []  # nothing was measured


def test_disk_gbps_takes_the_reader_where_it_beat_fio(tmp_path: Path):
    ctx = Context(out=tmp_path, work=tmp_path, quick=True, threads=2, rounds=1)
    rec = lim.QWEN3_RECORD_NBYTES
    ctx.results["limits"] = {
        "disk": [{"record_nbytes": rec, "qd": q, "gbps": 1.0} for q in (1, 8, 32)],
        "reader": [
            {"record_nbytes": rec, "qd": 8, "gbps": 3.0},
            {"record_nbytes": rec, "qd": 32, "gbps": 0.5},
        ],
    }
    assert lim.disk_gbps(ctx, rec, 8) == 3.0  # the reader's higher figure
    assert lim.disk_gbps(ctx, rec, 32) == 1.0  # fio's, where fio was higher
    assert lim.disk_gbps(ctx, rec, 16) == pytest.approx(2.0)  # halfway in log2 between 8 and 32


def test_write_file_leaves_no_partial_file(tmp_path, monkeypatch):
    """An interrupted fio file (Ctrl-C, SIGTERM, a full disk) is removed, not left behind
    at gigabytes; a finished one is renamed into place."""
    import os

    from colibri.bench import io as bench_io

    path = str(tmp_path / "f.bin")
    bench_io.write_file(path, 3 << 20)
    assert os.path.getsize(path) == 3 << 20 and os.listdir(tmp_path) == ["f.bin"]

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_io.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench_io.write_file(str(tmp_path / "g.bin"), 1 << 20)
    assert os.listdir(tmp_path) == ["f.bin"]
