"""clb_matmul at every ISA level against a float64 numpy reference and the scalar twin."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from colibri.compute import ops, ref
from colibri.errors import KernelError
from tests.kernel_util import (
    ALL_TYPES,
    FLOAT_TYPES,
    MATMUL_TOL,
    matmul_err,
    needs_avx512_emulation,
    random_weights,
    run_avx512_emulated,
)

SHAPES = [(1, 32), (13, 64), (67, 96), (40, 544)]  # rows not a multiple of 8/16, odd blocks


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_matmul_vs_numpy(isa, qt, rows, cols, n):
    rng = np.random.default_rng(rows * 1000 + cols + n)
    data, w = random_weights(rng, qt, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = np.full((n, rows), np.nan, np.float32)
    ops.matmul(data, qt, x, y)
    assert matmul_err(y, ref.matmul(w, x), x, w) <= MATMUL_TOL


@pytest.mark.parametrize("qt", FLOAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [1, 7, 33, 95])
def test_float_formats_odd_widths(isa, qt, cols):
    rng = np.random.default_rng(cols)
    data, w = random_weights(rng, qt, 9, cols)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    y = ops.matmul(data, qt, x, np.empty((5, 9), np.float32))
    assert matmul_err(y, ref.matmul(w, x), x, w) <= MATMUL_TOL


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
def test_simd_matches_scalar_twin(isa, qt):
    rng = np.random.default_rng(7)
    data, w = random_weights(rng, qt, 37, 256)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    y = ops.matmul(data, qt, x, np.empty((6, 37), np.float32))
    ops.set_isa(ops.ISA.SCALAR)
    y_ref = ops.matmul(data, qt, x, np.empty((6, 37), np.float32))
    assert matmul_err(y, y_ref, x, w) <= MATMUL_TOL


def test_matvec_1d_threads_and_buffers(isa):
    """1-D x/out, every buffer kind for w, identical results for any thread count."""
    rng = np.random.default_rng(3)
    data, w = random_weights(rng, ops.QType.Q4_0, 301, 2048)
    x = rng.standard_normal(2048).astype(np.float32)
    y1 = ops.matmul(data, "q4_0", x, np.empty(301, np.float32), nthreads=1)
    for buf in (memoryview(data), bytes(data), bytearray(data.tobytes()), data.ravel()):
        for nthreads in (0, 2, 3):
            y = ops.matmul(buf, "q4_0", x, np.empty(301, np.float32), nthreads=nthreads)
            np.testing.assert_array_equal(y, y1)
    assert matmul_err(y1[None], ref.matmul(w, x[None]), x[None], w) <= MATMUL_TOL


@pytest.mark.parametrize("cols", [32, 256, 544])
def test_f32_rows_do_not_depend_on_their_neighbours(isa, cols):
    """F32 weights: each output is the same bits whatever x rows and weight rows share the
    call, for any thread count (batch invariance), and matches numpy."""
    rng = np.random.default_rng(cols)
    rows = 53  # neither a multiple of 3 nor of 16: every edge tile
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal((37, cols)).astype(np.float32)
    full = ops.matmul(w, "f32", x, np.empty((37, rows), np.float32))
    assert matmul_err(full, ref.matmul(w, x), x, w) <= MATMUL_TOL
    for start, n in [(0, 1), (1, 2), (5, 3), (2, 4), (7, 5), (11, 9), (0, 37)]:
        for nthreads in (1, 2):
            y = ops.matmul(w, "f32", x[start : start + n], np.empty((n, rows), np.float32),
                           nthreads=nthreads)  # fmt: skip
            np.testing.assert_array_equal(y, full[start : start + n])
    for r0, r1 in [(1, 2), (3, 40), (17, 53)]:  # other weight rows beside each row
        part = np.ascontiguousarray(w[r0:r1])
        y = ops.matmul(part, "f32", x, np.empty((37, r1 - r0), np.float32))
        np.testing.assert_array_equal(y, full[:, r0:r1])
    y = ops.matmul(w, "f32", x[4], np.empty(rows, np.float32))  # matvec
    np.testing.assert_array_equal(y, full[4])


def test_matmul_bad_arguments():
    w = np.zeros((4, ops.row_nbytes("q8_0", 64)), np.uint8)
    x, y = np.zeros((2, 64), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(KernelError, match="w has 271 bytes"):
        ops.matmul(w.ravel()[:-1], "q8_0", x, y)
    with pytest.raises(KernelError, match="x must be a C-contiguous float32"):
        ops.matmul(w, "q8_0", x.astype(np.float64), y)
    with pytest.raises(KernelError, match="x must be a C-contiguous float32"):
        ops.matmul(w, "q8_0", np.zeros((2, 128), np.float32)[:, ::2], y)
    with pytest.raises(KernelError, match=r"\[n, cols\] and \[n, rows\]"):
        ops.matmul(w, "q8_0", x, np.zeros((3, 4), np.float32))
    with pytest.raises(KernelError, match="out must be writable"):
        y.flags.writeable = False
        ops.matmul(w, "q8_0", x, y)
    with pytest.raises(KernelError, match="multiple of the block size"):
        ops.matmul(w, "q8_0", np.zeros((2, 48), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(KernelError, match="w must be a numpy array"):
        ops.matmul([0] * 136, "q8_0", x, np.zeros((2, 4), np.float32))


def test_selfcheck_cli(capsys):
    from colibri.cli import main

    assert main(["selfcheck", "--isa", "scalar", "--isa", "avx512"]) == 0
    out = capsys.readouterr().out
    assert "matmul" in out and "expert_ffn" in out and " checks passed" in out


@needs_avx512_emulation
def test_avx512_emulated(tmp_path):
    """arch/avx512.c compiled on SIMDe's portable AVX-512 against the scalar twin: all formats,
    odd sizes, n = 1..8, bias/scale/accumulate (tests/avx512_emu/harness.c); quant.c and
    kquants.c quantize / dequantize the types."""
    run_avx512_emulated(
        tmp_path, "avx512.c", "harness.c", ["quant.c", "kquants.c", "pool.c", "isa.c"]
    )


def test_isa_forcing():
    with pytest.raises(KernelError, match="unknown ISA level 'sse9'"):
        ops.set_isa("sse9")
    code = "from colibri.compute import ops; print(ops.isa().name, ops.default_threads())"
    env = {**os.environ, "COLIBRI_ISA": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["SCALAR", str(ops.default_threads())]
    if ops.best_isa() < ops.ISA.AVX512:
        env["COLIBRI_ISA"] = "avx512"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode != 0 and "COLIBRI_ISA" in out.stderr


def test_default_threads_is_physical_cores():
    path = "/sys/devices/system/cpu/cpu0/topology/thread_siblings_list"
    per_core = 1
    if os.path.exists(path):
        with open(path) as f:
            parts = [p.split("-") for p in f.read().strip().split(",")]
        per_core = sum(int(p[-1]) - int(p[0]) + 1 for p in parts)
    assert ops.default_threads() == max(1, os.sysconf("SC_NPROCESSORS_ONLN") // per_core)


# ---- the kernel thread pool (csrc/pool.c) ---------------------------------------------------


def _pool_workload(seed: int):
    """A matvec and an expert FFN big enough to be threaded, with their 1-thread results."""
    rng = np.random.default_rng(seed)
    w, _ = random_weights(rng, ops.QType.Q4_0, 512, 1024)
    shapes = ((256, 512), (256, 512), (512, 256))  # gate, up, down
    gate, up, down = (random_weights(rng, ops.QType.Q8_0, *s)[0] for s in shapes)
    x, xf = (
        rng.standard_normal(1024).astype(np.float32),
        rng.standard_normal(512).astype(np.float32),
    )

    def run(nthreads: int) -> tuple[np.ndarray, np.ndarray]:
        y = ops.matmul(w, "q4_0", x, np.empty(512, np.float32), nthreads=nthreads)
        f = ops.expert_ffn(np.zeros(512, np.float32), xf, gate, up, down, "q8_0", 512, 256,
                           nthreads=nthreads)  # fmt: skip
        return y, f

    return run, run(1)


def _same(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_pool_concurrent_python_threads():
    """Kernels called from several Python threads at once (GIL released): one gets the pool,
    the others run on their own thread; every result is bit-identical, nothing hangs."""
    import threading

    errors: list[str] = []

    def worker(seed: int) -> None:
        run, want = _pool_workload(seed)
        for i in range(60):
            got = run((0, 2, 1)[i % 3])
            if not _same(got, want):
                errors.append(f"thread {seed} iteration {i}: result differs from 1 thread")

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "kernel calls hung (pool deadlock?)"
    assert errors == []


def test_pool_is_persistent():
    """Threaded calls reuse the same worker threads: the process's thread count is stable."""
    if ops.default_threads() < 2:
        pytest.skip("one physical core: kernels never start pool threads")
    run, _ = _pool_workload(7)
    run(0)
    before = len(os.listdir("/proc/self/task"))
    for _ in range(50):
        run(0)
    assert len(os.listdir("/proc/self/task")) == before


def test_pool_in_forked_child():
    """After fork() (pool threads exist in the parent only) the child gets a new pool:
    threaded kernels there finish and give the 1-thread result."""
    import time

    run, want = _pool_workload(11)
    run(0)  # the parent's pool exists before the fork
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery, just an exit code
        code = 3
        try:
            ok = all(_same(run(n), want) for n in (0, 2) * 10)
            # only the forking thread survives a fork: the rest must be the child's new pool
            pool_ok = len(os.listdir("/proc/self/task")) == max(1, ops.default_threads())
            code = 0 if ok and pool_ok else 1 if not ok else 4
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("threaded kernel in a forked child hung")
    code = os.waitstatus_to_exitcode(done[1])
    assert code != 4, "the child did not start its own pool threads"
    assert code == 0, "the child's results differ from 1 thread"
    assert _same(run(0), want)  # the parent's pool still works
