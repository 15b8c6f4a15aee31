"""Issue 12, hangs, tracebacks and leftovers: bounded chat templates, closing the engine under a
running stream, one-line errors for bad configs, contexts, prompts and traces, and clean-up
on SIGTERM / SIGHUP and on a full file system."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from colibri.convert import convert
from colibri.engine import open_engine
from colibri.errors import ColibriError, TokenizerError
from colibri.io.trace import RoutingTrace, RoutingTraceWriter, TraceError
from colibri.run import DEMO_STORE
from colibri.tokenizer import Tokenizer
from tests import hf_models
from tests.test_reliability_store import cli_error, colibri, edit_manifest, one_line_error


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    model = hf_models.build("mixtral", seed=2)
    return hf_models.save(model, tmp_path_factory.mktemp("relcli") / "hf")


@pytest.fixture(scope="module")
def base_store(hf_src):
    out = hf_src.parent / "store"
    convert(hf_src, out, quant="q8_0", dense_quant="q8_0", show_progress=False)
    return out


@pytest.fixture
def store(base_store, tmp_path):
    shutil.copytree(base_store, tmp_path / "store")
    return tmp_path / "store"


def leftovers(directory: Path, stem: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.lstrip(".").startswith(stem))


# ---- item 7: chat templates bounded in time and size ----------------------------------------


def word_tokenizer(directory: Path, template: str) -> Path:
    """A word-level tokenizer.json built here, and `template` as chat_template.jinja."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hi": 1, "there": 2, "</s>": 3}
    backend = Backend(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (directory / "chat_template.jinja").write_text(template)
    return directory


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}BODY{% endfor %}{% endfor %}"
BOMBS = {
    "nested_loops_output": (LOOP.replace("BODY", "{{ j }}"), "characters|took longer"),
    "nested_loops_silent": (LOOP.replace("BODY", ""), "took longer"),
    "concat_doubling": (
        '{% set ns = namespace(s="ab") %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}'
        "{% endfor %}{{ ns.s | length }}",
        r"more than \d+ characters \(~\)",
    ),
    "plus_doubling": (
        '{% set ns = namespace(s=["a"]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}'
        "{% endfor %}{{ ns.s | length }}",
        "exceeds",
    ),
    "repeat": ('{{ "x" * 10000000000 }}', "exceeds"),
    "power": ("{{ 10 ** 100000000 }}", "too large"),
    "center": ('{{ "x".center(10000000000) }}', "an argument above"),
    "join_doubling": (
        '{% set ns = namespace(s="ab") %}{% for i in range(64) %}'
        "{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}{{ ns.s | length }}",
        "exceeds",
    ),
}


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_chat_template_render_is_bounded(tmp_path, case):
    template, message = BOMBS[case]
    tok = Tokenizer.from_dir(word_tokenizer(tmp_path / "tok", template))
    assert tok.template_seconds <= 10 and tok.template_max_chars <= 1 << 24  # finite defaults
    # a bomb the size bound must stop gets time to spare: on a loaded machine its few ms of
    # rendering must not run into the deadline first
    seconds = 0.5 if "took longer" in message else 5.0
    tok.template_seconds, tok.template_max_chars = seconds, 1 << 20
    t0 = time.monotonic()
    with pytest.raises(TokenizerError, match=message) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < seconds + 2.5
    assert str(info.value).startswith(f"{tmp_path / 'tok' / 'chat_template.jinja'}: chat template")


def test_ordinary_template_still_renders(tmp_path):
    template = (
        "{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] }}\n{% endfor %}"
        "{% for i in range(3) %}{{ i * 2 }}{% endfor %}{{ 'ab' * 2 }}{{ [1] + [2] }}"
    )
    tok = Tokenizer.from_dir(word_tokenizer(tmp_path / "tok", template))
    out = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert out == "user: hi there\n024abab[1, 2]"


def test_chat_template_bomb_through_the_cli(store, tmp_path):
    word_tokenizer(store, '{{ "x" * 10000000000 }}')
    res = colibri("run", str(store), "--chat", "-p", "hi", "-n", "2", "--io", "threads")
    one_line_error(res, str(store / "chat_template.jinja"), "exceeds")


# ---- item 8: closing the engine while another task streams ------------------------------------


async def test_close_while_a_stream_computes_ends_it_cancelled(base_store):
    started = asyncio.Event()
    items = []

    async def consume(engine):
        async for t in engine.stream([1, 2, 3, 4], max_tokens=200, temperature=0):
            items.append(t)

    async with open_engine(base_store, io="threads") as engine:
        forward, calls = engine.pipeline.forward_batch, [0]

        async def counted(*a, **kw):
            calls[0] += 1
            if calls[0] == 4:  # the third decode step: close lands mid-forward
                started.set()
                await asyncio.sleep(0)
            return await forward(*a, **kw)

        engine.pipeline.forward_batch = counted  # every step of the scheduler
        task = asyncio.ensure_future(consume(engine))
        await asyncio.wait_for(started.wait(), 60)
    await asyncio.wait_for(task, 30)  # raises if the stream raised
    assert task.exception() is None
    assert items[-1].finish_reason == "cancelled" and items[-1].statistics is not None
    assert 1 <= sum(t.token_id is not None for t in items) < 200


async def test_close_while_a_stream_is_paused_ends_it_cancelled(base_store):
    async with open_engine(base_store, io="threads") as engine:
        stream = engine.stream([5, 6, 7], max_tokens=50, temperature=0)
        first = await stream.__anext__()
    rest = [t async for t in stream]  # resumed after close
    assert first.token_id is not None
    # tokens the scheduler computed before the close are still delivered, then "cancelled"
    assert rest[-1].finish_reason == "cancelled" and len(rest) < 50
    assert all(t.finish_reason is None and t.token_id is not None for t in rest[:-1])


def test_sync_engine_closed_from_another_thread_ends_the_stream_cancelled(base_store):
    import threading

    from colibri.engine import SyncEngine

    engine = SyncEngine(base_store, io="threads")
    items, errors, started = [], [], threading.Event()

    def consume():
        try:
            for t in engine.stream([1, 2, 3], max_tokens=2000, temperature=0):
                items.append(t)
                started.set()
        except Exception as exc:  # the stream must not raise
            errors.append(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(60)
    engine.close()
    thread.join(60)
    assert not thread.is_alive() and errors == []
    assert items[-1].finish_reason == "cancelled" and len(items) < 2000
    assert not engine._thread.is_alive()
    with pytest.raises(ColibriError, match="the engine is closed"):
        engine.generate([1, 2], max_tokens=2)


# ---- item 9: one-line errors ------------------------------------------------------------------


def edit_config(src: Path, tmp_path: Path, value) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(value(cfg) if callable(value) else value))
    return dst


CONFIG_CASES = {
    "list": ([1, 2], "config.json: is a JSON list, not an object"),
    "layers_null": (lambda c: c | {"num_hidden_layers": None}, "missing field 'num_hidden_layers'"),
    "ffn_list": (lambda c: c | {"intermediate_size": [96]}, "field 'intermediate_size' is [96]"),
    "layers_1e9_float": (lambda c: c | {"num_hidden_layers": 1e9}, "is 1000000000.0"),
    "layers_1e9": (
        lambda c: c | {"num_hidden_layers": 10**9},
        "'num_hidden_layers' is 1000000000, but the checkpoint's tensors cover 3 layers",
    ),
    "top_k_str": (lambda c: c | {"num_experts_per_tok": "2"}, "field 'num_experts_per_tok'"),
    "eps_nan": (lambda c: c | {"rms_norm_eps": float("nan")}, "field 'rms_norm_eps'"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_json_is_one_line(hf_src, tmp_path, capsys, case):
    value, message = CONFIG_CASES[case]
    src = edit_config(hf_src, tmp_path, value)
    if "1e9" in case:  # under a memory and time limit: it used to allocate until killed
        res = colibri("convert", str(src), str(tmp_path / "out"), memory=2 << 30, timeout=60)
        line = one_line_error(res)
    else:
        line = cli_error(capsys, "convert", src, tmp_path / "out")
    assert str(src / "config.json") in line and message in line
    assert not leftovers(tmp_path, "out")


def test_huge_context_says_how_much_kv_memory(store):
    edit_manifest(store, lambda m: m["config"].update(max_position_embeddings=2**31))
    n_ctx = 10**9
    cfg = json.loads((store / "manifest.json").read_text())["config"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    need = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 2 * head_dim * 4 * n_ctx
    res = colibri("run", str(store), "--ctx", str(n_ctx), "-p", "x", "--io", "threads")
    one_line_error(res, f"context length {n_ctx}", f"needs {need / 2**30:.2f} GiB", "--ctx")


def test_non_utf8_prompt_on_argv():
    res = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "-p", b"caf\xff!", "-n", "2"],
        capture_output=True,
        timeout=120,
    )
    res.stderr = res.stderr.decode()
    one_line_error(res, "--prompt is not valid UTF-8 text (byte 0xff at character 3)")


def test_non_utf8_line_on_chat_stdin_is_skipped():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "chat",
            "-n",
            "3",
            "--temperature",
            "0",
            "--io",
            "threads",
        ],
        input=b"caf\xff\nThe for statement\n\n",
        capture_output=True,
        timeout=120,
    )
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert "Traceback" not in err
    assert "input line is not valid UTF-8 text (byte 0xff at character 3); line ignored" in err
    assert "3 generated tokens" in err  # the next line was answered


def test_non_utf8_text_to_the_api_is_a_tokenizer_error():
    tok = Tokenizer.from_dir(DEMO_STORE)
    with pytest.raises(TokenizerError, match="not valid UTF-8 text"):
        tok.encode("caf\udcff")
    with pytest.raises(TokenizerError, match=r"lone surrogate U\+D800"):
        tok.encode("a\ud800")


def test_replay_empty_trace(tmp_path, capsys):
    path = tmp_path / "empty.npz"
    RoutingTraceWriter(4, 2, 8).save(path)
    for extra in ([], ["--offline"]):
        line = cli_error(capsys, "replay", path, *extra, "--synthetic-dir", tmp_path)
        assert str(path) in line and "no routing steps" in line
    assert leftovers(tmp_path, "colibri-replay") == []


def test_replay_trace_with_more_experts_than_the_store(base_store, tmp_path, capsys):
    w = RoutingTraceWriter(3, 2, 8)
    for t in range(4):
        for layer in range(3):
            w.record(t, layer, [t % 8, 7], [0.5, 0.5])
    path = tmp_path / "t.npz"
    w.save(path)
    line = cli_error(capsys, "replay", path, "--store", base_store, "--io", "threads")
    assert str(path) in line and "expert 7" in line and "6 experts per layer" in line
    w = RoutingTraceWriter(5, 2, 6)
    w.record(0, 4, [0, 1], [0.5, 0.5])
    w.save(path)
    line = cli_error(capsys, "replay", path, "--store", base_store, "--io", "threads")
    assert str(path) in line and "layers [4]" in line


# ---- item 11: signals and a full file system --------------------------------------------------

SLOW = """
import pathlib, sys, time
import {module} as m
original = m.{func}
def slow(*a, **kw):
    pathlib.Path({mark!r}).touch()
    time.sleep(0.3)
    return original(*a, **kw)
m.{func} = slow
from colibri.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_and_signal(tmp_path: Path, module: str, func: str, args: list[str], signum: int):
    mark = tmp_path / "started"
    code = SLOW.format(module=module, func=func, mark=str(mark))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mark.exists(), proc.communicate()
    proc.send_signal(signum)
    _out, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_convert_removes_the_temporary(hf_src, tmp_path, signum):
    out = tmp_path / "out"
    rc, err = run_and_signal(
        tmp_path, "colibri.convert.hf", "quantize", ["convert", str(hf_src), str(out)], signum
    )
    assert rc == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_export_gguf_removes_the_temporary(tmp_path, signum):
    pytest.importorskip("gguf")
    out = tmp_path / "demo.gguf"
    args = ["export-gguf", str(DEMO_STORE), str(out)]
    rc, err = run_and_signal(tmp_path, "colibri.export_gguf", "_dense_bytes", args, signum)
    assert rc == 128 + signum, err
    assert "Traceback" not in err
    assert leftovers(tmp_path, "demo.gguf") == []


def test_run_trace_onto_a_full_file_system(tmp_path):
    """RLIMIT_FSIZE makes the trace's writes fail (EFBIG) as a full disk would (ENOSPC)."""
    trace = tmp_path / "trace.npz"

    res = subprocess.run(
        [sys.executable, "-m", "colibri", "run", "-n", "20", "--seed", "0", "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=fsize_limited(1000),
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    errors = [x for x in res.stderr.splitlines() if x.startswith("colibri: error:")]
    assert errors == [f"colibri: error: {trace}: cannot write the trace: File too large"]
    assert "20 generated tokens" in res.stderr  # the answer itself was shown
    assert os.listdir(tmp_path) == []


def test_trace_save_on_enospc_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    def full(path, **arrays):
        Path(path).write_bytes(b"PK partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(np, "savez", full)
    t = RoutingTrace(np.zeros((2, 3, 2), np.int32), np.zeros((2, 3, 2), np.float32), 8)
    with pytest.raises(TraceError, match=f"{tmp_path / 't.npz'}: cannot write the trace: No space"):
        t.save(tmp_path / "t.npz")
    assert os.listdir(tmp_path) == []


async def test_engine_close_reports_an_unwritable_trace_and_still_closes(base_store, tmp_path):
    trace = tmp_path / "gone" / "t.npz"
    with pytest.raises(ColibriError, match=r"option trace=.*: directory .*gone does not exist"):
        async with open_engine(base_store, trace=str(trace)):
            pass
    trace.parent.mkdir()
    with pytest.raises(ColibriError, match=f"{trace}: cannot write the trace"):
        async with open_engine(base_store, io="threads", trace=str(trace)) as engine:
            async for _ in engine.stream([1, 2], max_tokens=2):
                pass
            trace.parent.rmdir()  # the directory goes away before the trace is written
    assert engine.pipeline.executor._shutdown


def fsize_limited(nbytes: int):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return limit


def test_convert_and_export_onto_a_full_file_system(hf_src, tmp_path):
    """Writes past RLIMIT_FSIZE fail (EFBIG) as on a full disk (ENOSPC): one line naming
    OUT, and neither OUT nor a temporary is left."""
    pytest.importorskip("gguf")
    for args, out in (
        (["convert", str(hf_src), str(tmp_path / "out")], tmp_path / "out"),
        (["export-gguf", str(DEMO_STORE), str(tmp_path / "o.gguf")], tmp_path / "o.gguf"),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "colibri", *args],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=fsize_limited(100_000),
        )
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        errors = [x for x in res.stderr.splitlines() if x.startswith("colibri: error:")]
        assert len(errors) == 1 and f"{out}: cannot write" in errors[0], res.stderr
        if args[0] == "convert":  # numpy's tofile reports a short write without errno
            assert "File too large" in errors[0]
        assert os.listdir(tmp_path) == []
