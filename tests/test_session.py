"""Sessions: a conversation saved after a turn and reopened in a fresh engine continues with
the same greedy tokens as the uninterrupted one (and as a fresh prefill of the whole
conversation); f16 KV files are half the size; every refusal names the file and the reason."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest

from colibri.engine import EngineOptions, open_engine
from colibri.errors import ColibriError
from colibri.run import DEMO_STORE
from colibri.session import SessionError

TURN1 = [{"role": "user", "content": "What is a list?"}]
USER2 = {"role": "user", "content": "And a tuple?"}
N = 12


async def answer(session, messages) -> tuple[list[int], str]:
    ids, text = [], []
    async for t in session.stream(messages, max_tokens=N, temperature=0):
        if t.token_id is not None:
            ids.append(t.token_id)
        text.append(t.text)
    return ids, "".join(text)


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_reopened_session_continues_exactly(tmp_path, kv):
    path = tmp_path / "chat.session"

    async def uninterrupted():
        async with open_engine(DEMO_STORE, kv_dtype=kv) as eng:
            s = eng.new_session(TURN1)
            _, a1 = await answer(s, s.messages)
            s.messages.append({"role": "assistant", "content": a1})
            eng.save_session(path, s)
            s.messages.append(USER2)
            ids2, _ = await answer(s, s.messages)
            # a fresh prefill of the whole conversation, no session
            fresh = [
                t.token_id
                async for t in eng.stream(s.messages, max_tokens=N, temperature=0)
                if t.token_id is not None
            ]
            return ids2, fresh, list(s.messages)

    async def reopened():
        async with open_engine(DEMO_STORE, kv_dtype=kv, io="threads", budget=1 << 20) as eng:
            s = eng.load_session(path)
            n_before = len(s.tokens)
            s.messages.append(USER2)
            ids2, _ = await answer(s, s.messages)
            return ids2, n_before, s

    ids2, fresh, messages = asyncio.run(uninterrupted())
    again, n_before, s = asyncio.run(reopened())
    assert len(ids2) == N and again == ids2
    assert fresh == ids2
    assert s.messages == messages and n_before > 10
    assert not list(tmp_path.glob(".*"))  # written through a temporary, renamed


def test_session_turns_run_in_the_engines_scheduler(tmp_path):
    """A session turn is a generation of the engine's scheduler: decoded in the same batch as
    a concurrent stream, its tokens are those of the turn alone and the stream's are those of
    the stream alone (batch invariance); a turn left after 3 tokens leaves the session whole
    (its tokens match its KV cache: it saves, and the next turn answers as a fresh prefill)."""

    async def run():
        async with open_engine(DEMO_STORE, io="threads") as eng:
            other = [{"role": "user", "content": "Write a for statement"}]

            async def stream_ids():
                gen = eng.stream(other, max_tokens=N, temperature=0, ignore_eos=True)
                return [t.token_id async for t in gen if t.token_id is not None]

            alone_stream = await stream_ids()
            alone_turn, _ = await answer(eng.new_session(TURN1), TURN1)
            s = eng.new_session(TURN1)
            before = eng.statistics(components=False)
            (turn, _), streamed = await asyncio.gather(answer(s, TURN1), stream_ids())
            generated = eng.statistics(components=False).delta(before).generated_tokens
            left = eng.new_session(TURN1)
            got = 0
            async for t in left.stream(TURN1, max_tokens=N, temperature=0):
                got += t.token_id is not None
                if got == 3:
                    break
            messages = [*TURN1, {"role": "assistant", "content": "A list."}, USER2]
            cont, _ = await answer(left, messages)
            eng.save_session(tmp_path / "left.session", left)
            fresh = [
                t.token_id
                async for t in eng.stream(messages, max_tokens=N, temperature=0)
                if t.token_id is not None
            ]
            return alone_stream, alone_turn, turn, streamed, generated, cont, fresh

    alone_stream, alone_turn, turn, streamed, generated, cont, fresh = asyncio.run(run())
    assert turn == alone_turn and streamed == alone_stream
    assert generated == len(turn) + len(streamed)  # both counted by the scheduler
    assert cont == fresh and len(cont) > 0


def test_a_turn_cancelled_or_left_early_leaves_the_session_whole(tmp_path):
    """Ctrl-C in `colibri chat` (the task reading a turn is cancelled mid-answer): the session
    saves at once and reopens; a turn left with `break` is refused by save_session with a
    clear error until its stream is closed (the event loop closes it a moment later)."""
    import contextlib

    async def run():
        async with open_engine(DEMO_STORE, io="threads") as eng:
            s = eng.new_session(TURN1)
            seen = asyncio.Event()

            async def read():
                async for t in s.stream(TURN1, max_tokens=200, temperature=0, ignore_eos=True):
                    if t.token_id is not None:
                        seen.set()

            task = asyncio.ensure_future(read())
            await seen.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            eng.save_session(tmp_path / "cancelled.session", s)  # no wait needed
            n = len(s.tokens)
            gen = s.stream(TURN1, max_tokens=200, temperature=0)
            async for t in gen:
                if t.token_id is not None:
                    break
            with pytest.raises(ColibriError, match="a turn is still generating"):
                eng.save_session(tmp_path / "left.session", s)
            await gen.aclose()
            eng.save_session(tmp_path / "left.session", s)
            async with contextlib.aclosing(s.stream(TURN1, max_tokens=200)) as g:
                async for _ in g:
                    break
            eng.save_session(tmp_path / "closed.session", s)
        async with open_engine(DEMO_STORE, io="threads") as eng:
            again = eng.load_session(tmp_path / "cancelled.session")
            return n, len(again.tokens)

    n, reopened = asyncio.run(run())
    assert n == reopened > len(TURN1[0]["content"]) // 4


def test_f16_sessions_are_half_the_size(tmp_path):
    async def save(kv):
        async with open_engine(DEMO_STORE, kv_dtype=kv) as eng:
            s = eng.new_session(TURN1)
            await answer(s, s.messages)
            return eng.save_session(tmp_path / f"{kv}.session", s).stat().st_size, len(s.tokens)

    (f32, n), (f16, n2) = asyncio.run(save("f32")), asyncio.run(save("f16"))
    values = n * 4 * 2 * 2 * 48  # tokens x layers x (k, v) x kv heads x head_dim
    header = {}
    for kv in ("f32", "f16"):
        raw = (tmp_path / f"{kv}.session").read_bytes()
        hlen = int.from_bytes(raw[8:12], "little")
        header[kv] = json.loads(raw[20 : 20 + hlen])
        assert len(raw) == 20 + hlen + header[kv]["payload_nbytes"]
    assert n == n2
    assert header["f32"]["payload_nbytes"] == 4 * values
    assert header["f16"]["payload_nbytes"] == 2 * values
    assert {a["dtype"] for a in header["f16"]["arrays"]} == {"float16"}
    assert f32 - f16 == 2 * values + len(json.dumps(header["f32"], separators=(",", ":"))) - len(
        json.dumps(header["f16"], separators=(",", ":"))
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "chat.session"

    async def run():
        async with open_engine(DEMO_STORE) as eng:
            s = eng.new_session(TURN1)
            await answer(s, s.messages)
            eng.save_session(path, s)

    asyncio.run(run())
    return path


def load(path, store=DEMO_STORE, **options):
    async def run():
        async with open_engine(store, **options) as eng:
            return eng.load_session(path)

    return asyncio.run(run())


def damaged(saved, tmp_path, offset: int | None = None, cut: int | None = None):
    data = bytearray(saved.read_bytes())
    if offset is not None:
        data[offset % len(data)] ^= 0x20
    if cut is not None:
        data = data[:cut]
    out = tmp_path / "bad.session"
    out.write_bytes(bytes(data))
    return out


def test_refusals(saved, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(DEMO_STORE, other)
    (other / "manifest.json").write_text((other / "manifest.json").read_text() + " ")
    cases = [
        (lambda: load(saved, other), "a session of another store"),
        (lambda: load(saved, kv_dtype="f16"), "session made with kv_dtype='f32'"),
        (
            lambda: load(saved, activations="f32"),
            f"session made with activations={EngineOptions().activations!r}",
        ),
        (lambda: load(saved, n_ctx=8), "engine's context holds 8"),
        (lambda: load(damaged(saved, tmp_path, offset=-100)), "payload checksum mismatch"),
        (lambda: load(damaged(saved, tmp_path, offset=40)), "damaged session header"),
        (lambda: load(damaged(saved, tmp_path, cut=saved.stat().st_size - 1)), "cut short"),
        (lambda: load(damaged(saved, tmp_path, cut=10)), "not a colibri session"),
        (lambda: load(DEMO_STORE / "manifest.json"), "not a colibri session"),
    ]
    for fn, message in cases:
        with pytest.raises(SessionError) as exc:
            fn()
        assert message in str(exc.value), (message, str(exc.value))
        assert "session" in str(exc.value)


def chat(lines: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", "chat", "-n", str(N), "--temperature", "0", *args],
        input=lines,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_chat_reopened_from_its_session_answers_as_the_uninterrupted_chat(tmp_path):
    whole = chat("What is a list?\nAnd a tuple?\n\n")
    assert whole.returncode == 0, whole.stderr
    s = str(tmp_path / "c.session")
    first = chat("What is a list?\n\n", "--session", s)
    second = chat("And a tuple?\n\n", "--session", s)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    assert "resumed" in second.stderr and "2 messages" in second.stderr
    # whole.stdout is "> answer1> answer2> "; the two sessions give "> answer1> " and "> answer2> "
    assert whole.stdout == first.stdout + second.stdout[2:]
    bad = chat("hi\n\n", "--session", s, "--kv", "f16")
    assert bad.returncode == 1 and "session made with kv_dtype='f32'" in bad.stderr
    assert "Traceback" not in bad.stderr
