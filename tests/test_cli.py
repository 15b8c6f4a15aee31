"""The command line end to end on a converted tiny model with a real tokenizer, and the
errors users meet: one clear line, a non-zero exit code, no traceback."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from colibri.cli import COMMANDS
from colibri.convert import convert
from tests import hf_models

torch = hf_models.torch


def colibri(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = hf_models.save_with_tokenizer("mixtral", root / "hf", seed=2)
    convert(root / "hf", root / "store", quant="q8_0", dense_quant="q8_0")
    return model, root / "hf", root / "store"


def test_run_streams_greedy_text_and_statistics(tiny):
    model, hf, store = tiny
    prompt = "The quick brown fox"
    res = colibri("run", str(store), "-p", prompt, "-n", "12", "--io", "threads")
    assert res.returncode == 0, res.stderr
    tok = __import__("transformers").AutoTokenizer.from_pretrained(hf)
    ids = tok(prompt, return_tensors="pt").input_ids
    # transformers on the float weights; q8_0 storage may flip a near-tie, so compare the
    # text only when transformers' greedy choice had a clear margin
    gen = hf_models.greedy(model, ids[0].tolist(), 12)
    assert res.stdout.startswith(prompt)
    text = res.stdout[len(prompt) :]
    if hf_models.router_gap(model, ids[0].tolist() + gen) > 1e-2:
        assert text == tok.decode(gen)
    line = res.stderr.strip().splitlines()[-1]
    assert re.search(
        r"\d+ prompt \+ 12 generated tokens, length; TTFT \d+ ms; [\d.]+ tok/s; "
        r"hit rate [\d.]+%; read [\d.]+ [KMG]iB/token; RSS",
        line,
    ), line


def test_chat_renders_template(tiny):
    _, _, store = tiny
    res = subprocess.run(
        [sys.executable, "-m", "colibri", "chat", str(store), "-n", "4", "--io", "threads"],
        input="hello\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "generated tokens" in res.stderr


@pytest.mark.parametrize(
    "case, args, message",
    [
        ("missing", ["run", "/nonexistent/store", "-p", "x"], r"/nonexistent/store"),
        ("not a store", ["run", "{tmp}", "-p", "x"], r"manifest"),
        ("context", ["run", "{store}", "-p", "word " * 64, "--ctx", "16"], r"prompt too long"),
        ("sampling", ["run", "{store}", "-p", "x", "--temperature", "-1"], r"temperature"),
        ("budget", ["run", "{store}", "-p", "x", "--budget", "lots"], r"invalid size"),
        (
            "ctx 0",
            ["run", "{store}", "-p", "x", "--ctx", "0"],
            r"--ctx must be .* >= 1 \(got '0'\)",
        ),
        ("ctx text", ["serve", "{store}", "--ctx", "4k"], r"--ctx must be a whole number .*'4k'"),
        # the tiny models' max_position_embeddings is 256: more is refused, naming both
        (
            "ctx above max",
            ["run", "{store}", "-p", "x", "--ctx", "257"],
            r"--ctx 257 exceeds the model's context length 256 \(max_position_embeddings\)",
        ),
        (
            "chat ctx above max",
            ["chat", "{store}", "--ctx", "100000"],
            r"--ctx 100000 exceeds the model's context length 256",
        ),
    ],
)
def test_bad_input_one_clear_line(tiny, tmp_path, case, args, message):
    _, _, store = tiny
    args = [a.format(tmp=tmp_path, store=store) for a in args]
    res = colibri(*args)
    assert res.returncode != 0, case
    assert "Traceback" not in res.stderr, res.stderr
    assert re.search(message, res.stderr), res.stderr


def test_ctx_at_the_models_maximum_runs(tiny):
    """--ctx equal to max_position_embeddings (256) is accepted; the default (4096, above it)
    is quietly the model's maximum."""
    _, _, store = tiny
    for extra in (["--ctx", "256"], []):
        res = colibri("run", str(store), "-p", "x", "-n", "2", "--io", "threads", *extra)
        assert res.returncode == 0, res.stderr
        assert "2 generated tokens" in res.stderr


def test_corrupt_record_is_reported(tiny, tmp_path):
    _, _, store = tiny
    bad = tmp_path / "store"
    subprocess.run(["cp", "-r", str(store), str(bad)], check=True)
    with open(bad / "experts.bin", "r+b") as f:  # flip one byte of every record's start
        import json

        for rec in json.loads((bad / "manifest.json").read_text())["experts"]:
            f.seek(rec["offset"] + 100)
            b = f.read(1)
            f.seek(rec["offset"] + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    res = colibri("run", str(bad), "-p", "hello", "-n", "2")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert re.search(r"checksum mismatch in layer \d+ expert \d+", res.stderr), res.stderr


@pytest.mark.parametrize("model_type", hf_models.BASE_CASES)
def test_run_and_chat_every_architecture(model_type, tmp_path):
    """run and chat on a converted tiny model of each supported architecture: the streamed
    text is the tokenizer's decoding of transformers' greedy tokens for the same prompt."""
    model = hf_models.save_with_tokenizer(model_type, tmp_path / "hf", seed=1)
    convert(tmp_path / "hf", tmp_path / "store", quant="f32", dense_quant="f32")
    prompt = "Streaming experts from disk"
    res = colibri("run", str(tmp_path / "store"), "-p", prompt, "-n", "8")
    assert res.returncode == 0, res.stderr
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok(prompt).input_ids
    gen = hf_models.greedy(model, ids, 8)
    gap = hf_models.choice_gap(model, ids + gen)
    print(f"{model_type}: smallest routing/argmax gap {gap:.2e}")
    if gap > 1e-4:  # else a near-tie may legitimately flip
        assert res.stdout == prompt + tok.decode(gen)
    res = subprocess.run(
        [sys.executable, "-m", "colibri", "chat", str(tmp_path / "store"), "-n", "3"],
        input="hi\nand again\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("generated tokens") == 2


def test_run_without_a_model_uses_the_embedded_demo():
    res = colibri("run", "-n", "24", "--seed", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("The for statement") and len(res.stdout) > 40
    assert "24 generated tokens" in res.stderr
    again = colibri("run", "-n", "24", "--seed", "0")
    assert again.stdout == res.stdout  # same seed, same text


def test_run_records_a_routing_trace_that_replay_reads(tmp_path):
    trace = tmp_path / "t.npz"
    res = colibri("run", "-n", "8", "--seed", "0", "--trace", str(trace))
    assert res.returncode == 0, res.stderr
    from colibri.io.trace import RoutingTrace

    t = RoutingTrace.load(trace)
    prompt_tokens = int(re.search(r"(\d+) prompt", res.stderr).group(1))
    assert t.experts.shape == (prompt_tokens + 8 - 1, 4, 2)  # the last token is not run
    assert ((t.experts >= 0) & (t.experts < 8)).all()
    np.testing.assert_allclose(t.weights.sum(-1), 1.0, rtol=1e-5)  # Mixtral renormalises
    res = colibri("replay", str(trace), "--offline", "--budget-records", "8")
    assert res.returncode == 0 and "belady" in res.stdout, res.stderr


# (argv, the one line printed): every subcommand that shares run's options names the option
# and its rule before opening any model (the store path need not exist)
BAD_VALUES = [
    (["run", "--ctx", "0"], "colibri run: --ctx must be a whole number >= 1 (got '0')"),
    (["chat", "--ctx", "4k"], "colibri chat: --ctx must be a whole number >= 1 (got '4k')"),
    (["serve", "--ctx", "-1"], "colibri serve: --ctx must be a whole number >= 1 (got '-1')"),
    (["eval", "--ctx", "0"], "colibri eval: --ctx must be a whole number >= 1 (got '0')"),
    (["plan", "--ctx", "0"], "colibri plan: --ctx must be a whole number >= 1 (got '0')"),
    (["doctor", "--ctx", "0"], "colibri doctor: --ctx must be a whole number >= 1 (got '0')"),
    (
        ["run", "--budget", "0"],
        "colibri run: --budget must be a positive number of bytes (got '0')",
    ),
    (
        ["serve", "--budget", "lots"],
        "colibri serve: --budget: invalid size 'lots' (examples: 512M, 4G, 1.5GiB)",
    ),
    (
        ["plan", "--budget", "0"],
        "colibri plan: --budget must be a positive number of bytes (got '0')",
    ),
    # a negative size is a value, not an option ("--budget: expected one argument")
    (
        ["run", "--budget", "-1G"],
        "colibri run: --budget must be a positive number of bytes (got '-1G')",
    ),
    (
        ["chat", "--budget=-1G"],
        "colibri chat: --budget must be a positive number of bytes (got '-1G')",
    ),
    (
        ["serve", "--prefix-cache", "-.5M"],
        "colibri serve: --prefix-cache must be a number of bytes >= 0 (got '-.5M')",
    ),
    (["run", "-n", "0"], "colibri run: -n/--max-tokens must be a whole number >= 1 (got '0')"),
    (
        ["run", "--temperature", "-1"],
        "colibri run: --temperature must be a number >= 0; 0 is greedy (got '-1')",
    ),
    (
        ["chat", "--temp", "nan"],
        "colibri chat: --temperature must be a number >= 0; 0 is greedy (got 'nan')",
    ),
    (["run", "--top-p", "2"], "colibri run: --top-p must be a number in (0, 1] (got '2')"),
    (["run", "--top-p", "0"], "colibri run: --top-p must be a number in (0, 1] (got '0')"),
    (
        ["run", "--top-k", "-3"],
        "colibri run: --top-k must be a whole number >= 0; 0: off (got '-3')",
    ),
    (["run", "--min-p", "1.5"], "colibri run: --min-p must be a number in [0, 1] (got '1.5')"),
    (
        ["run", "--repetition-penalty", "0"],
        "colibri run: --repetition-penalty must be a number > 0; 1: off (got '0')",
    ),
    (
        ["chat", "--presence-penalty", "3"],
        "colibri chat: --presence-penalty must be a number in [-2, 2] (got '3')",
    ),
    (["run", "--seed", "-1"], "colibri run: --seed must be a whole number >= 0 (got '-1')"),
    (
        ["run", "--threads", "x"],
        "colibri run: --threads must be a whole number >= 0; 0: one per physical core (got 'x')",
    ),
    (
        ["eval", "--queue-depth", "0"],
        "colibri eval: --queue-depth must be a whole number in [1, 32768]; io_uring's ring "
        "limit (got '0')",
    ),
    # refused, not quietly read with threads because io_uring cannot make such a ring
    (
        ["run", "--queue-depth", "100000"],
        "colibri run: --queue-depth must be a whole number in [1, 32768]; io_uring's ring "
        "limit (got '100000')",
    ),
    (
        ["replay", "t.npz", "--queue-depth", "-4"],
        "colibri replay: --queue-depth must be a whole number in [1, 32768]; io_uring's ring "
        "limit (got '-4')",
    ),
    (
        ["run", "--owners-per-node", "0"],
        "colibri run: --owners-per-node must be a whole number >= 1 (got '0')",
    ),
    (["plan", "--call-ms", "-1"], "colibri plan: --call-ms must be a number >= 0 (got '-1')"),
    (
        ["run", "--io", "disk"],
        "colibri run: --io: invalid choice: 'disk' (choose from 'auto', "
        "'uring', 'threads', 'mmap')",
    ),
    (
        ["serve", "--frob"],
        "colibri serve: unrecognized arguments: --frob (`colibri serve --help` lists the options)",
    ),
    (
        ["serve", "--parallel", "0"],
        "colibri serve: --parallel must be a whole number >= 1 (got '0')",
    ),
    (
        ["serve", "--max-queue", "-1"],
        "colibri serve: --max-queue must be a whole number >= 0 (got '-1')",
    ),
    (
        ["serve", "--drain-timeout", "-1"],
        "colibri serve: --drain-timeout must be a number >= 0 (got '-1')",
    ),
    (
        ["serve", "--max-body", "0"],
        "colibri serve: --max-body must be a positive number of bytes (got '0')",
    ),
    (["tune", "--seconds", "0"], "colibri tune: --seconds must be a number > 0 (got '0')"),
    (["bench", "--rounds", "0"], "colibri bench: --rounds must be a whole number >= 1 (got '0')"),
    (["eval", "--limit", "0"], "colibri eval: --limit must be a whole number >= 1 (got '0')"),
    (["eval", "--shots", "-1"], "colibri eval: --shots must be a whole number >= 0 (got '-1')"),
    (["frob"], "colibri: unknown command 'frob'; commands: " + ", ".join(COMMANDS)),
    (
        ["evl", "--limit", "3"],
        "colibri: unknown command 'evl'; did you mean 'eval'? commands: " + ", ".join(COMMANDS),
    ),
]


@pytest.mark.parametrize("argv, line", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_option_value_is_one_line_exit_2(capsys, argv, line):
    from colibri import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def _accepts(parse, text):
    import argparse

    try:
        parse(text)
    except argparse.ArgumentTypeError:
        return False
    return True


PROBES = ["-3", "-2", "-1", "-0.5", "0", "0.5", "1", "1.5", "2", "2.5", "30", "nan", "inf"]


@pytest.mark.parametrize(
    "flag, field, kind",
    [
        ("--temperature", "temperature", float),
        ("--top-k", "top_k", int),
        ("--top-p", "top_p", float),
        ("--min-p", "min_p", float),
        ("--repetition-penalty", "repetition_penalty", float),
        ("--presence-penalty", "presence_penalty", float),
        ("--frequency-penalty", "frequency_penalty", float),
        ("--seed", "seed", int),
        ("--max-tokens", "max_tokens", int),
        ("--threads", "threads", int),
        ("--queue-depth", "queue_depth", int),
        ("--queue-depth", "queue_depth", "large"),
        ("--owners-per-node", "owners_per_node", int),
        ("--ctx", "n_ctx", int),
        ("--budget", "budget", "size"),
    ],
)
def test_cli_ranges_are_the_libraries_ranges(flag, field, kind):
    """An option's value is accepted by the command line exactly when SamplingParams or
    EngineOptions accepts it (the rules are written twice; this holds them together)."""
    import argparse

    from colibri.engine import EngineOptions
    from colibri.errors import ColibriError
    from colibri.options import parse_size
    from colibri.run import configure_parser
    from colibri.sampling import SamplingParams

    p = argparse.ArgumentParser()
    configure_parser(p)
    parse = next(a for a in p._actions if flag in a.option_strings).type
    owner = SamplingParams if field in SamplingParams.__dataclass_fields__ else EngineOptions
    probes = PROBES
    if kind == "large":  # the upper end of a range (--queue-depth: io_uring's ring limit)
        kind, probes = int, ["32767", "32768", "32769", "100000"]
    for text in probes:
        try:
            if kind == "size":
                value = parse_size(text)
            else:
                value = kind(float(text)) if kind is int else float(text)
        except (OverflowError, ValueError):  # int(nan), int(inf): never a whole number
            assert not _accepts(parse, text), (flag, text)
            continue
        if kind is int and value != float(text):
            assert not _accepts(parse, text), (flag, text)
            continue
        try:
            owner(**{field: value})
            library = True
        except ColibriError:
            library = False
        assert _accepts(parse, text) == library, (flag, text, library)


@pytest.mark.parametrize(
    "argv, code",
    [
        (["plan", "--json"], 141),
        (["plan"], 141),
        (["doctor"], 141),
        (["run", "-n", "64"], 141),
        (["--help"], 0),  # argparse ignores a failed write of its help itself
    ],
)
def test_a_closed_stdout_ends_quietly(argv, code):
    """`colibri plan --json | head -1`: when the reader of stdout has gone, the command stops
    without "Broken pipe" or a traceback, with 141 (128 + SIGPIPE, as `yes | head` shows)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "colibri", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p.stdout.close()  # before the command writes anything: its first write meets EPIPE
    err = p.stderr.read()
    assert p.wait(timeout=300) == code, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception" not in err, err


def test_threads_above_the_pool_are_said_once():
    """--threads above the physical cores runs at most the kernels' pool (one thread per
    physical core): said on one line, not silently clamped."""
    from colibri.compute import ops

    cores = ops.default_threads()
    res = colibri("run", "-n", "2", "--io", "threads", "--threads", str(cores + 62))
    assert res.returncode == 0, res.stderr
    line = f"colibri: --threads {cores + 62}: kernels run at most {cores} threads here"
    assert res.stderr.count(line) == 1, res.stderr
    res = colibri("run", "-n", "2", "--io", "threads", "--threads", str(cores))
    assert res.returncode == 0 and "kernels run at most" not in res.stderr, res.stderr
