"""The kernels section's cache handling: its weights are evicted from an L3 that could hold them."""

from colibri.bench import kernels


def test_l3_nbytes_takes_the_largest_cache(tmp_path):
    for i, size in enumerate(["48K", "2048K", "480M"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    (tmp_path / "index9").mkdir()  # no size file: skipped
    assert kernels.l3_nbytes(str(tmp_path)) == 480 << 20
    assert kernels.l3_nbytes(str(tmp_path / "missing")) == 0


def test_l3_evictor_only_when_the_l3_could_hold_the_weights():
    import numpy as np

    w = np.ones(1 << 20, np.uint8)
    assert kernels.l3_evictor(w, l3=1 << 20) is None  # 1 MiB is more than half of 1 MiB
    assert kernels.l3_evictor(w, l3=0) is None  # no cache reported
    evict = kernels.l3_evictor(w, l3=8 << 20)
    assert evict is not None
    evict()  # clflush of every line: runs, leaves the data as it was
    assert int(w.sum()) == 1 << 20
