"""Mirrors: `colibri mirror` makes a verified copy; a MirrorReader spreads records over copies
by drive weight, fails over on a read error or a checksum mismatch (reported, never computed
on), and the engine's greedy output is the same with one, two or no mirrors."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from colibri.engine import open_engine
from colibri.errors import ReadError, StoreError
from colibri.io.format import open_store
from colibri.io.mirror import MirrorReader, open_mirror, write_mirror
from colibri.io.reader import ThreadReader
from colibri.io.slab import SlabPool
from colibri.io.trace import RoutingTrace
from colibri.run import DEMO_STORE

RECORD = 196608
PROMPT = "The for statement"
SMALL = 4 * RECORD  # 4 of 32 records cached: most tokens read records


@pytest.fixture(scope="module")
def demo():
    return open_store(DEMO_STORE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy text and expert usage of the demo with no mirror."""
    trace = tmp_path_factory.mktemp("ref") / "t.npz"
    text = asyncio.run(generate(trace=str(trace)))[0]
    t = RoutingTrace.load(trace)
    return text, collections.Counter((layer, e) for _, layer, ex in t.steps() for e in ex)


async def generate(n: int = 24, **options) -> tuple[str, tuple]:
    async with open_engine(DEMO_STORE, budget=SMALL, **options) as eng:
        text = await eng.generate(PROMPT, max_tokens=n, temperature=0)
        drives = getattr(eng.reader, "drive_statistics", lambda: ())()
        return text, drives, getattr(eng.reader, "failovers", 0), eng.cache.statistics()


def test_mirror_is_a_verified_byte_identical_copy(demo, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "colibri", "mirror", str(DEMO_STORE), str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "verified byte for byte and 32 record checksums" in res.stdout
    copy = tmp_path / "m" / "experts.bin"
    assert copy.read_bytes() == (DEMO_STORE / "experts.bin").read_bytes()
    meta = json.loads((tmp_path / "m" / "mirror.json").read_text())
    assert meta["experts_nbytes"] == copy.stat().st_size == 32 * RECORD
    assert open_mirror(demo, tmp_path / "m").experts_path == copy
    assert not list((tmp_path / "m").glob(".*"))  # no temporaries left


def test_refusals(demo, tmp_path):
    with pytest.raises(StoreError, match="not a mirror"):
        open_mirror(demo, tmp_path)
    write_mirror(demo, tmp_path / "m")
    other = tmp_path / "other"
    shutil.copytree(DEMO_STORE, other)
    (other / "manifest.json").write_text((other / "manifest.json").read_text() + "\n")
    with pytest.raises(StoreError, match="a mirror of another store"):
        open_mirror(open_store(other), tmp_path / "m")
    with open(tmp_path / "m" / "experts.bin", "r+b") as f:
        f.truncate(RECORD)
    with pytest.raises(StoreError, match=f"{RECORD} bytes, the store's experts file has"):
        open_mirror(demo, tmp_path / "m")
    with pytest.raises(StoreError, match="is the store itself"):
        write_mirror(demo, DEMO_STORE)
    with pytest.raises(StoreError, match=r"neither it nor its parent .* exists"):
        write_mirror(demo, tmp_path / "unmounted" / "m")
    assert not (tmp_path / "unmounted").exists()
    (tmp_path / "m" / "mirror.json").write_text("{")
    res = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "-n", "2", "--mirror", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "unreadable mirror description" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_flipped_byte_in_one_copy_is_served_from_the_other(demo, tmp_path, reference, caplog):
    want, usage = reference
    m = write_mirror(demo, tmp_path / "m")
    # the most used record that the hash sends to the mirror copy first
    pool = SlabPool(RECORD, 1)
    probe = MirrorReader(
        [ThreadReader(str(demo.experts_path), pool), ThreadReader(str(m.experts_path), pool)], demo
    )
    key = next(k for k, _ in usage.most_common() if probe.order(*k)[0] == 1)
    asyncio.run(probe.aclose())
    rec = demo.record(*key)
    with open(m.experts_path, "r+b") as f:
        f.seek(rec.offset + 1000)
        b = f.read(1)
        f.seek(rec.offset + 1000)
        f.write(bytes([b[0] ^ 0x01]))
    with caplog.at_level(logging.WARNING, logger="colibri.io.mirror"):
        text, drives, failovers, _ = asyncio.run(generate(mirrors=(str(tmp_path / "m"),)))
    assert text == want
    assert drives[1].checksum_failures >= 1 and drives[0].checksum_failures == 0
    assert failovers == drives[1].checksum_failures
    msgs = [r.getMessage() for r in caplog.records]
    assert any(
        f"{m.experts_path}: checksum mismatch in layer {key[0]} expert {key[1]}" in s
        and "reading it from" in s
        for s in msgs
    ), msgs


def test_two_mirrors_give_the_output_of_one_copy(demo, tmp_path, reference):
    dirs = tuple(str(write_mirror(demo, tmp_path / f"m{i}").path) for i in (1, 2))
    text, drives, failovers, cache = asyncio.run(generate(mirrors=dirs))
    assert text == reference[0]
    assert len(drives) == 3 and all(d.reads > 0 for d in drives)
    assert sum(d.reads for d in drives) == cache.reads and failovers == 0
    assert sum(d.bytes_read for d in drives) == cache.bytes_read
    one, *_ = asyncio.run(generate(mirrors=dirs[:1]))
    assert one == text


async def _read_all(reader: MirrorReader, demo) -> list[bytes]:
    out = []
    for r in demo.records:
        await reader.read_into(r, 0)
        out.append(bytes(reader.pool.view(0)[: r.nbytes]))
    return out


def test_read_errors_fail_over_and_all_copies_failing_raises(demo, tmp_path):
    m = write_mirror(demo, tmp_path / "m")
    pool = SlabPool(RECORD, 1)
    a, b = ThreadReader(str(demo.experts_path), pool), ThreadReader(str(m.experts_path), pool)
    reader = MirrorReader([a, b], demo, weights=[1.0, 1.0])

    async def broken(record, slot, *, priority=0):
        raise ReadError(f"{b.path}: read of layer {record.layer} failed: EIO")

    b.read_into = broken
    data = (DEMO_STORE / "experts.bin").read_bytes()

    async def run():
        got = await _read_all(reader, demo)
        assert got == [data[r.offset : r.offset + r.nbytes] for r in demo.records]
        a.read_into = broken
        with pytest.raises(ReadError, match="EIO"):
            await reader.read_into(demo.records[0], 0)
        await reader.aclose()

    asyncio.run(run())
    d = reader.drive_statistics()
    routed_to_b = sum(reader.order(r.layer, r.expert)[0] == 1 for r in demo.records)
    assert 0 < routed_to_b < 32
    assert d[1].errors == routed_to_b + 1 and d[1].reads == 0 and d[0].reads == 32
    assert reader.failovers == routed_to_b
    assert reader.statistics().errors == routed_to_b + 2


def test_rendezvous_shares_follow_the_weights(demo):
    pool = SlabPool(4096, 1)
    r = MirrorReader(
        [ThreadReader(str(demo.experts_path), pool) for _ in range(2)], demo, weights=[3.0, 1.0]
    )
    firsts = np.array([r.order(layer, e)[0] for layer in range(100) for e in range(100)])
    assert abs((firsts == 0).mean() - 0.75) < 0.02
    assert r.order(7, 3) == r.order(7, 3)
    with pytest.raises(ValueError, match="2 positive weights"):
        MirrorReader([c.reader for c in r.copies], demo, weights=[1, 0])
    asyncio.run(r.aclose())


def test_tune_measures_each_mirror_drive_and_run_weights_by_it(demo, tmp_path, monkeypatch):
    from colibri import machine
    from colibri.run import configure_parser, engine_options

    if machine.mount_of(DEMO_STORE).device == machine.mount_of("/dev/shm").device:
        pytest.skip("the checkout is on /dev/shm already")
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="colibri-mirror-")
    try:
        write_mirror(demo, shm)
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
        res = subprocess.run(
            [sys.executable, "-m", "colibri", "tune", "--seconds", "0.05", "--mirror", shm],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr
        prof = machine.load_profile()
        devices = {machine.mount_of(DEMO_STORE).device, machine.mount_of(shm).device}
        assert set(prof.drives) == devices
        p = __import__("argparse").ArgumentParser()
        configure_parser(p)
        opts, _ = engine_options(p.parse_args(["--mirror", shm]), DEMO_STORE)
        qd = opts["queue_depth"]
        assert opts["mirrors"] == (shm,)
        assert opts["mirror_weights"] == (
            prof.drive_gbps(demo.experts_path, qd),
            prof.drive_gbps(f"{shm}/experts.bin", qd),
        )
    finally:
        shutil.rmtree(shm)
