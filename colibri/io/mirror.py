"""Several drives: byte-identical copies of a store's experts file, and a reader over them.

`colibri mirror STORE DIR` writes DIR/<experts file> (a copy made through a temporary file,
flushed, dropped from the page cache and read back: every byte compared with the source and
every record's XXH3-64 checked, then renamed into place) and DIR/mirror.json naming the store
by the SHA-256 of its manifest, so a mirror of another store (or another version) is refused.

MirrorReader reads each record from one copy, chosen by weighted rendezvous hashing of
(layer, expert) (Thaler & Ravishankar 1998; weights: each drive's measured GB/s), so records
spread over the drives in proportion to their speed and each record always goes to the same
drive (its hot records are spread too, not just its traffic). A read error or a checksum
mismatch on one copy is retried on the next copy in that record's order, counted and logged
as a warning (logger "colibri.io.mirror"); nothing unverified is handed on. If every copy
fails, the last error is raised. Statistics per copy: reads, bytes, busy seconds, GB/s while
busy, errors, checksum failures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from colibri.errors import ReadError, StoreError
from colibri.io.format import MANIFEST, ExpertRecord
from colibri.io.reader import DEMAND, Reader, ReaderStatistics, open_reader
from colibri.io.slab import SlabPool

MIRROR_META = "mirror.json"
MIRROR_FORMAT = "colibri-mirror"
MIRROR_VERSION = 1
COPY_CHUNK = 8 << 20
log = logging.getLogger("colibri.io.mirror")


def manifest_sha256(store_path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a store's manifest.json bytes: names one store and version exactly."""
    return hashlib.sha256((Path(store_path) / MANIFEST).read_bytes()).hexdigest()


@dataclass(frozen=True)
class Mirror:
    """An opened mirror directory: `path`, the copy `experts_path`."""

    path: Path
    experts_path: Path


def open_mirror(store: Any, directory: str | os.PathLike[str]) -> Mirror:
    """Check that `directory` holds a mirror of `store` (mirror.json names the same manifest
    hash; the copy has the store's size). Raises StoreError naming the file otherwise."""
    d = Path(directory)
    meta_path = d / MIRROR_META
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{meta_path}: not a mirror (run `colibri mirror STORE {d}`)") from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"{meta_path}: unreadable mirror description ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != MIRROR_FORMAT:
        raise StoreError(f"{meta_path}: not a colibri mirror description")
    if meta.get("version") != MIRROR_VERSION:
        raise StoreError(f"{meta_path}: mirror version {meta.get('version')!r}, expected 1")
    want = manifest_sha256(store.path)
    if meta.get("manifest_sha256") != want:
        raise StoreError(
            f"{meta_path}: a mirror of another store (manifest sha256 "
            f"{str(meta.get('manifest_sha256'))[:12]}…, {store.path} has {want[:12]}…)"
        )
    experts = d / str(meta.get("experts_file", ""))
    if not experts.is_file():
        raise StoreError(f"{experts}: the mirror's experts file is missing")
    size, need = experts.stat().st_size, int(store.manifest.get("experts_nbytes", -1))
    if size != need:
        raise StoreError(f"{experts}: {size} bytes, the store's experts file has {need}")
    if os.path.samefile(experts, store.experts_path):
        raise StoreError(f"{experts}: is the store's own experts file, not a copy")
    return Mirror(d, experts)


def write_mirror(store: Any, directory: str | os.PathLike[str], log_to: Any = None) -> Mirror:
    """Copy the store's experts file into `directory` (created if its parent exists: a
    mistyped or unmounted drive path is refused, not silently made on the root disk),
    verify the copy byte for byte after dropping it from the page cache, check every
    record's checksum in it, then rename it into place and write mirror.json. Returns the
    Mirror.
    Raises StoreError when the copy differs (the temporary is removed), the directory is
    the store's own, or neither it nor its parent exists."""
    d = Path(directory)
    if not d.is_dir():
        if not d.parent.is_dir():
            raise StoreError(
                f"{d}: neither it nor its parent {d.parent} exists (is the drive mounted?); "
                f"create the directory first"
            )
        d.mkdir()
    if d.resolve() == Path(store.path).resolve():
        raise StoreError(f"{d}: is the store itself; a mirror goes to another drive")
    name = Path(store.experts_path).name
    tmp = d / f".{name}.tmp{os.getpid()}"
    src_path = store.experts_path
    try:
        t0 = time.perf_counter()
        with open(src_path, "rb", buffering=0) as src, open(tmp, "wb", buffering=0) as dst:
            while chunk := src.read(COPY_CHUNK):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
            os.posix_fadvise(dst.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t_copy = time.perf_counter() - t0
        with open(src_path, "rb", buffering=0) as a, open(tmp, "rb", buffering=0) as b:
            offset = 0
            while True:
                x, y = a.read(COPY_CHUNK), b.read(COPY_CHUNK)
                if x != y:
                    raise StoreError(
                        f"{tmp}: the copy differs from {src_path} in the {COPY_CHUNK >> 20} MiB "
                        f"from byte {offset} (bad drive or memory?); nothing was kept"
                    )
                if not x:
                    break
                offset += len(x)
        with open(tmp, "rb", buffering=0) as b:
            for r in store.records:
                buf = os.pread(b.fileno(), r.nbytes, r.offset)
                if len(buf) != r.nbytes or xxhash.xxh3_64_intdigest(buf) != r.xxh3:
                    raise StoreError(
                        f"{tmp}: layer {r.layer} expert {r.expert} fails its checksum "
                        f"(the store itself may be damaged: colibri inspect --verify)"
                    )
        os.replace(tmp, d / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    meta = {
        "format": MIRROR_FORMAT,
        "version": MIRROR_VERSION,
        "store": str(Path(store.path).resolve()),
        "manifest_sha256": manifest_sha256(store.path),
        "experts_file": name,
        "experts_nbytes": offset,
    }
    meta_tmp = d / f".{MIRROR_META}.tmp{os.getpid()}"
    meta_tmp.write_text(json.dumps(meta, indent=1))
    os.replace(meta_tmp, d / MIRROR_META)
    if log_to is not None:
        gbps = offset / max(t_copy, 1e-9) / 1e9
        print(
            f"copied {offset} bytes to {d / name} ({gbps:.2f} GB/s written), verified "
            f"byte for byte and {len(store.records)} record checksums",
            file=log_to,
        )
    return Mirror(d, d / name)


@dataclass(frozen=True, slots=True)
class DriveStatistics:
    """One copy: path, weight (relative share), reads served, bytes_read, busy_seconds (time
    with at least one read in flight), gbps (bytes_read / busy_seconds / 1e9), errors (read
    errors), checksum_failures."""

    path: str
    weight: float
    reads: int
    bytes_read: int
    busy_seconds: float
    gbps: float
    errors: int
    checksum_failures: int


class _Copy:
    def __init__(self, reader: Reader, weight: float) -> None:
        self.reader, self.weight = reader, weight
        self.reads = self.nbytes = self.errors = self.bad = self.in_flight = 0
        self.busy = 0.0
        self.since = 0.0
        self.verified: set[tuple[int, int]] = set()

    def begin(self) -> None:
        if self.in_flight == 0:
            self.since = time.perf_counter()
        self.in_flight += 1

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.busy += time.perf_counter() - self.since


class MirrorReader(Reader):
    """Reads over several copies of one experts file (module docstring); the Reader interface.

    Args: readers: one open Reader per copy, all over the same SlabPool (the first is the
    store's own file); store: has verify_record(record, buffer) or records carrying xxh3;
    weights: relative read shares (default equal; e.g. each drive's GB/s); verify: True
    checks every read, "once" each record's first read from each copy, False never (a read
    error still fails over). Raises ValueError on mismatched pools or weights.
    """

    backend = "mirror"

    def __init__(
        self,
        readers: list[Reader],
        store: Any,
        weights: list[float] | None = None,
        verify: bool | str = True,
    ) -> None:
        if not readers:
            raise ValueError("MirrorReader needs at least one reader")
        pool = readers[0].pool
        if any(r.pool is not pool for r in readers):
            raise ValueError("MirrorReader: every copy's reader must fill the same SlabPool")
        weights = list(weights) if weights is not None else [1.0] * len(readers)
        if len(weights) != len(readers) or not all(w > 0 and math.isfinite(w) for w in weights):
            raise ValueError(f"MirrorReader: need {len(readers)} positive weights, got {weights}")
        super().__init__(readers[0].path, pool, sum(r.queue_depth for r in readers))
        self.store, self.verify = store, verify
        self.copies = [_Copy(r, w / sum(weights)) for r, w in zip(readers, weights, strict=True)]
        self.direct = all(r.direct for r in readers)
        self.fixed_buffers = all(r.fixed_buffers for r in readers)
        self.reason = f"{len(readers)} copies: " + "; ".join(
            f"{r.path} ({r.backend}, {r.reason})" for r in readers
        )
        self.failovers = 0

    def order(self, layer: int, expert: int) -> list[int]:
        """Copy indices for (layer, expert), best first: weighted rendezvous hashing, score
        -ln(u) / w with u uniform in (0, 1) from XXH64 of (layer, expert, copy)."""
        scores = []
        for i, c in enumerate(self.copies):
            h = xxhash.xxh64_intdigest(f"{layer}:{expert}:{i}".encode())
            u = (h + 0.5) / 2.0**64
            scores.append((-math.log(u) / c.weight, i))
        return [i for _, i in sorted(scores)]

    def _checked(self, c: _Copy, record: ExpertRecord, slot: int) -> StoreError | None:
        """None when the slot's bytes match the record's checksum (or need no check)."""
        key = (record.layer, record.expert)
        if self.verify is False or (self.verify == "once" and key in c.verified):
            return None
        buf = self.pool.view(slot)[: record.nbytes]
        try:
            verify = getattr(self.store, "verify_record", None)
            if verify is not None:
                verify(record, buf)
            elif xxhash.xxh3_64_intdigest(buf) != record.xxh3:
                raise StoreError(
                    f"{c.reader.path}: checksum mismatch in layer {key[0]} expert {key[1]}"
                )
        except StoreError as exc:
            c.bad += 1
            where = str(getattr(self.store, "experts_path", c.reader.path))
            return StoreError(str(exc).replace(where, c.reader.path))
        c.verified.add(key)
        return None

    async def read_into(self, record: ExpertRecord, slot: int, *, priority: int = DEMAND) -> None:
        """Fill the slot from the record's first copy that reads and verifies; see the module
        docstring. Raises the last ReadError / StoreError when every copy fails."""
        self._check(record, slot)
        order = self.order(record.layer, record.expert)
        last: Exception | None = None
        for n, i in enumerate(order):
            c = self.copies[i]
            c.begin()
            try:
                await c.reader.read_into(record, slot, priority=priority)
            except ReadError as exc:
                c.errors += 1
                last = exc
            else:
                last = self._checked(c, record, slot)
            finally:
                c.end()
            if last is None:
                c.reads += 1
                c.nbytes += record.nbytes
                self._reads += 1
                self._bytes += record.nbytes
                if n:
                    self.failovers += 1
                return
            self._errors += 1
            more = n + 1 < len(order)
            log.warning(
                "colibri: %s%s",
                last,
                f"; reading it from {self.copies[order[n + 1]].reader.path}" if more else "",
            )
        raise last  # type: ignore[misc]  # every copy failed

    def drive_statistics(self) -> tuple[DriveStatistics, ...]:
        """Per copy, in the order given."""
        return tuple(
            DriveStatistics(
                c.reader.path,
                c.weight,
                c.reads,
                c.nbytes,
                c.busy,
                c.nbytes / c.busy / 1e9 if c.busy > 0 else 0.0,
                c.errors,
                c.bad,
            )
            for c in self.copies
        )

    def statistics(self) -> ReaderStatistics:
        inner = [c.reader.statistics() for c in self.copies]
        return ReaderStatistics(
            "mirror",
            self.reason,
            self.direct,
            self.fixed_buffers,
            self.queue_depth,
            self._reads,
            self._bytes,
            self._errors,
            sum(s.retries for s in inner),
            sum(s.short_reads for s in inner),
            sum(s.in_flight for s in inner),
            sum(s.queued for s in inner),
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self.copies:
            await c.reader.aclose()


def open_mirrored_reader(
    store: Any,
    directories: list[str] | tuple[str, ...],
    backend: str = "auto",
    *,
    pool: SlabPool,
    queue_depth: int = 32,
    weights: list[float] | tuple[float, ...] | None = None,
    verify: bool | str = True,
) -> MirrorReader:
    """A MirrorReader over the store's experts file and each mirror directory (checked with
    open_mirror), one `backend` reader per copy. weights: one per copy, store first."""
    mirrors = [str(open_mirror(store, d).experts_path) for d in directories]  # all checked first
    files = [str(store.experts_path), *mirrors]
    readers = [open_reader(f, backend, pool=pool, queue_depth=queue_depth) for f in files]
    return MirrorReader(readers, store, list(weights) if weights else None, verify)


# ---- CLI: colibri mirror STORE DIR --------------------------------------------------------
def configure_parser(p: Any) -> None:
    p.add_argument("model", help="the store to mirror")
    p.add_argument("directory", help="where the copy goes (a directory on another drive)")


def run_cli(args: Any) -> int:
    import sys

    from colibri.io.format import open_store

    write_mirror(open_store(args.model), args.directory, log_to=sys.stdout)
    print(f"use it with: colibri run {args.model} --mirror {args.directory}")
    return 0
