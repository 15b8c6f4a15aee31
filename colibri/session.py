"""Conversations that survive a restart: a Session keeps one conversation's KV cache between
turns, and its file holds the tokens, the KV cache and the messages.

    session = engine.new_session()
    async for tok in session.stream(messages): ...       # prefills only what is new
    engine.save_session("chat.session", session)          # atomically, after each turn
    session = engine.load_session("chat.session")         # in a later process: continues
                                                          # exactly (same greedy tokens)

File layout (little-endian): b"CLBSESS\\x01", u32 header length, u64 XXH3-64 of the header,
the header (UTF-8 JSON), then the payload: each layer's keys then values for the `length`
tokens in the KV cache, in the cache's dtype (f16 with --kv f16; multi-head latent attention
layers keep one latent array). The header names the store by the SHA-256 of its manifest and
carries the payload's XXH3-64, the KV dtype, the activations mode, the array shapes, the token
ids and the messages (docs/OPERATIONS.md). A session of another store, another KV dtype or
activations mode, or a damaged or truncated file is refused with SessionError naming the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import time
from collections.abc import AsyncIterator, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from colibri.errors import ColibriError
from colibri.io.mirror import manifest_sha256

if TYPE_CHECKING:
    from colibri.engine import Engine, Sequence, Token

MAGIC = b"CLBSESS\x01"
FORMAT = "colibri-session"
VERSION = 1
_HEAD = struct.Struct("<8sIQ")
MAX_HEADER_NBYTES = 256 << 20


class SessionError(ColibriError):
    """A session file cannot be used here: another store or config, damaged, truncated."""


class Session:
    """One conversation on one engine: its Sequence (KV cache and tokens) kept across turns,
    and its messages (chat dicts; the caller appends the answers). Create with
    engine.new_session() or engine.load_session(path)."""

    def __init__(self, engine: Engine, seq: Sequence, messages: list[dict[str, Any]]) -> None:
        self.engine, self.seq, self.messages = engine, seq, messages
        self._active: Any = None  # the scheduler Generation of the last stream()

    @property
    def tokens(self) -> list[int]:
        """Token ids in the KV cache, in order."""
        return self.seq.tokens

    async def stream(
        self,
        prompt: str | Seq[Mapping[str, Any]] | Seq[int],
        *,
        max_tokens: int = 256,
        template_kwargs: Mapping[str, Any] | None = None,
        ignore_eos: bool = False,
        **sampling: Any,
    ) -> AsyncIterator[Token]:
        """Generate as Engine.stream() does, from the whole conversation `prompt` (messages
        rendered with the chat template, a string or token ids), feeding only the tokens after
        the longest prefix already in the KV cache (the cache is cut back to that prefix when
        the conversation diverges from it, e.g. a template that re-renders earlier turns).
        The generated tokens stay in the cache (all but the last, which the next turn feeds).
        Runs in the engine's scheduler as Engine.stream() does (batched with the other
        streams; ignore_eos as there). Yields Token items; the last carries finish_reason
        and statistics (prompt_tokens: the tokens fed now). Raises ColibriError when the
        conversation outgrows the context or holds an id outside the vocabulary."""
        from colibri.sampling import SamplingParams
        from colibri.scheduler import Generation

        eng = self.engine
        params = SamplingParams(max_tokens=max_tokens, **{**eng.generation_defaults, **sampling})
        t0 = time.perf_counter()
        ids = eng.prompt_ids(prompt, template_kwargs)
        prev = self._active  # a turn left early and not yet closed by the event loop
        if prev is not None and not prev.done:
            step = eng.scheduler.cancel(prev)
            if step is not None:  # in a step: its tokens reach the sequence first
                await asyncio.wait({step})
        if len(ids) >= self.seq.kv.n_ctx:
            raise ColibriError(
                f"conversation too long: {len(ids)} tokens, context length {self.seq.kv.n_ctx} "
                "(set n_ctx / --ctx)"
            )
        keep = 0
        for a, b in zip(self.seq.tokens, ids, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # feed at least one token: its logits start the answer
        if self.seq.kv.recurrent_state and keep < self.seq.length:
            keep = 0  # a hybrid model's recurrent state cannot be cut back: start over
        self.seq.truncate(keep)
        tok = eng.tokenizer
        eos = tok.eos_token_ids if tok is not None and not ignore_eos else frozenset()
        self._active = Generation(eng, ids, params, eos, t0, self.seq)
        async with contextlib.aclosing(eng.run_generation(self._active)) as items:
            async for item in items:
                yield item


def _arrays(seq: Sequence) -> list[tuple[str, np.ndarray]]:
    """(name, array) of the KV cache, each distinct array once (MLA layers share k and v),
    then the Gated DeltaNet layers' state (`.conv`, `.recurrent`: stored whole, see _part)
    and the DSA indexer key caches (`.index_k`), then DeepSeek-V4's compressor entries
    (`.compressed`) and window rows (`.compress_buf`, `.index_buf`: stored whole)."""
    out, seen = [], set()
    for i, (k, v) in enumerate(zip(seq.kv.k, seq.kv.v, strict=True)):
        for name, a in ((f"{i}.k", k), (f"{i}.v", v)):
            if id(a) not in seen and a.shape[0]:
                seen.add(id(a))
                out.append((name, a))
    for i, (c, r) in enumerate(zip(seq.kv.conv, seq.kv.recurrent, strict=False)):
        out += [(f"{i}.{name}", a) for name, a in (("conv", c), ("recurrent", r)) if a is not None]
    for i, a in enumerate(seq.kv.index_k):  # DSA indexer keys
        if a is not None:
            out.append((f"{i}.index_k", a))
    kv = seq.kv
    for i, arrs in enumerate(zip(kv.compressed, kv.compress_buf, kv.index_buf, strict=False)):
        names = ("compressed", "compress_buf", "index_buf")
        out += [(f"{i}.{name}", a) for name, a in zip(names, arrs, strict=True) if a is not None]
    return out


def _part(name: str, a: np.ndarray, n: int) -> np.ndarray:
    """The bytes of array `name` a session keeps: the first n positions of a key / value
    array, a recurrent state whole."""
    return a if name.endswith((".conv", ".recurrent", ".compress_buf", ".index_buf")) else a[:n]


def _config(engine: Engine) -> dict[str, Any]:
    return {"kv_dtype": engine.options.kv_dtype, "activations": engine.options.activations}


def save_session(engine: Engine, session: Session, path: str | os.PathLike[str]) -> Path:
    """Write `session` to `path` atomically (temporary file in the same directory, fsync,
    rename). Returns the path. Raises OSError when it cannot be written."""
    seq, n = session.seq, session.seq.length
    if session._active is not None and not session._active.done:
        raise ColibriError(
            "session: a turn is still generating (a stream left early is closed by the event "
            "loop a moment later: close it first, e.g. with contextlib.aclosing)"
        )
    if len(seq.tokens) != n:
        raise ColibriError(f"session: {len(seq.tokens)} tokens but {n} in the KV cache")
    parts, arrays, offset = [], [], 0
    for name, a in _arrays(seq):
        part = np.ascontiguousarray(_part(name, a, n))
        parts.append(part)
        arrays.append(
            {
                "name": name,
                "dtype": part.dtype.name,
                "shape": list(part.shape),
                "offset": offset,
                "nbytes": part.nbytes,
            }
        )
        offset += part.nbytes
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "store": str(engine.store.path),
        "store_manifest_sha256": manifest_sha256(engine.store.path),
        "model_type": engine.store.model_type,
        "config": _config(engine),
        "length": n,
        "tokens": [int(t) for t in seq.tokens],
        "messages": session.messages,
        "arrays": arrays,
        "payload_nbytes": offset,
        "payload_xxh3": f"{h.intdigest():016x}",
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, len(head), xxhash.xxh3_64_intdigest(head)))
            f.write(head)
            for part in parts:
                f.write(memoryview(part).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def load_session(engine: Engine, path: str | os.PathLike[str]) -> Session:
    """Read a session written by save_session into a fresh Sequence of `engine`.
    Raises SessionError naming the file: not a session, damaged (checksum) or truncated,
    of another store (manifest hash), another KV dtype or activations mode, arrays of
    another shape, or longer than the engine's context."""
    p = Path(path)
    with open(p, "rb") as f:
        raw = f.read(_HEAD.size)
        if len(raw) < _HEAD.size or raw[:8] != MAGIC:
            raise SessionError(f"{p}: not a colibri session file")
        _, hlen, hsum = _HEAD.unpack(raw)
        if hlen > MAX_HEADER_NBYTES:
            raise SessionError(f"{p}: damaged session header (length {hlen})")
        head = f.read(hlen)
        if len(head) != hlen or xxhash.xxh3_64_intdigest(head) != hsum:
            raise SessionError(f"{p}: damaged session header (checksum mismatch or cut short)")
        try:
            h = json.loads(head)
            if h.get("format") != FORMAT or h.get("version") != VERSION:
                raise SessionError(
                    f"{p}: session format {h.get('format')!r} version {h.get('version')!r}, "
                    f"this colibri reads {FORMAT!r} version {VERSION}"
                )
            want = manifest_sha256(engine.store.path)
            if h["store_manifest_sha256"] != want:
                raise SessionError(
                    f"{p}: a session of another store ({h.get('store')}, manifest sha256 "
                    f"{h['store_manifest_sha256'][:12]}…; {engine.store.path} has {want[:12]}…)"
                )
            for key, mine in _config(engine).items():
                if h["config"][key] != mine:
                    raise SessionError(
                        f"{p}: session made with {key}={h['config'][key]!r}, this engine has "
                        f"{key}={mine!r} (reopen with the same option)"
                    )
            n, tokens, arrays = int(h["length"]), [int(t) for t in h["tokens"]], h["arrays"]
            messages = list(h["messages"])
            payload_nbytes, payload_xxh3 = int(h["payload_nbytes"]), str(h["payload_xxh3"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SessionError(f"{p}: malformed session header ({exc!r})") from None
        payload = f.read(payload_nbytes + 1)
    if len(payload) != payload_nbytes:
        raise SessionError(
            f"{p}: payload is {len(payload)} bytes, the header says {payload_nbytes} "
            "(file cut short or appended to)"
        )
    if f"{xxhash.xxh3_64_intdigest(payload):016x}" != payload_xxh3:
        raise SessionError(f"{p}: damaged session (payload checksum mismatch)")
    seq = engine.new_sequence()
    if n > seq.kv.n_ctx or len(tokens) != n:
        raise SessionError(
            f"{p}: {n} tokens in the session, the engine's context holds {seq.kv.n_ctx} "
            "(reopen with a larger --ctx)"
            if n > seq.kv.n_ctx
            else f"{p}: {len(tokens)} token ids for {n} KV entries"
        )
    mine = _arrays(seq)
    if [a["name"] for a in arrays] != [name for name, _ in mine]:
        raise SessionError(
            f"{p}: KV arrays {[a['name'] for a in arrays][:4]}… do not match this model's layers"
        )
    for meta, (name, whole) in zip(arrays, mine, strict=True):
        dst = _part(name, whole, n)
        want_shape = list(dst.shape)
        if meta["dtype"] != dst.dtype.name or list(meta["shape"]) != want_shape:
            raise SessionError(
                f"{p}: KV array {name} is {meta['dtype']} {meta['shape']}, this model needs "
                f"{dst.dtype.name} {want_shape}"
            )
        begin, nbytes = int(meta["offset"]), int(meta["nbytes"])
        if begin < 0 or begin + nbytes > payload_nbytes or nbytes != dst.nbytes:
            raise SessionError(f"{p}: KV array {name} lies outside the payload")
        src = np.frombuffer(payload, dtype=dst.dtype, count=dst.size, offset=begin)
        dst[...] = src.reshape(dst.shape)
    seq.kv.length = n
    seq.tokens = tokens
    if any(t < 0 or t >= engine.spec.vocab_size for t in tokens):
        raise SessionError(f"{p}: token ids outside the vocabulary ({engine.spec.vocab_size})")
    return Session(engine, seq, messages)
