"""ops.mem_read (csrc/membench.c), the streaming read behind the benchmarks' memory read bound:
every byte is read, whatever the ISA level, thread count, size or alignment (its result is the
XOR of the buffer's 64-bit words, computed independently here with numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.compute import ops
from colibri.errors import KernelError


def _xor_words(b: np.ndarray) -> int:
    n8 = len(b) // 8 * 8
    s = int(np.bitwise_xor.reduce(b[:n8].view("<u8"))) if n8 else 0
    for v in b[n8:]:  # a tail of < 8 bytes enters byte by byte
        s ^= int(v)
    return s


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 255, 4096 + 3, (3 << 20) + 77])
def test_mem_read_reads_every_byte(isa, nbytes):
    rng = np.random.default_rng(nbytes)
    buf = rng.integers(0, 256, nbytes + 1, dtype=np.uint8)[1:]  # odd address
    want = _xor_words(buf)
    for t in (1, 2):
        assert ops.mem_read(buf, nthreads=t) == want
    if nbytes:
        flipped = buf.copy()
        flipped[-1] ^= 0x80  # the very last byte counts too
        assert ops.mem_read(flipped) != want


def test_mem_read_rejects_non_contiguous():
    with pytest.raises(KernelError, match="C-contiguous"):
        ops.mem_read(np.zeros((4, 4), np.uint8)[:, ::2])
