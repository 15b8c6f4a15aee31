"""`colibri run` and `colibri chat`: stream text from a store in the terminal.

run streams the answer to one prompt, then prints one statistics line (tokens, TTFT, tok/s,
hit rate, bytes read per token, resident memory). chat is a multi-turn REPL that renders the
conversation with the model's chat template. Ctrl-C stops the current answer (chat goes on;
run exits after printing what it has).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from colibri.engine import DEFAULT_N_CTX, Engine, GenerationStatistics, open_engine
from colibri.errors import ColibriError, TokenizerError
from colibri.io.cache import POLICIES
from colibri.options import (
    ctx_tokens,
    number,
    parse_size,  # noqa: F401  (cluster/shard.py imports it from here)
    positive_size,
    queue_depth,
    size_arg,  # noqa: F401  (serve/cli.py imports it from here)
    whole,
)
from colibri.tokenizer import check_utf8

DEMO_STORE = Path(__file__).parent / "data" / "demo"
DEMO_PROMPT = "The for statement"
CHAT_PREFIX_CACHE = 512 << 20  # bytes of prompt KV `colibri chat` keeps between turns


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """Options shared by run, chat and the benchmarks."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--budget",
        "--ram-budget",
        "--expert-cache",
        dest="budget",
        type=positive_size,
        help="bytes of RAM for the expert cache, e.g. 4G (default: all experts if they fit in "
        "half the available memory, else that half)",
    )
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default="nextuse",
        help="expert cache eviction policy (default nextuse: evict the record whose next use is "
        "estimated farthest, from the layer cycle and routing frequencies)",
    )
    g.add_argument(
        "--no-prefetch",
        dest="prefetch",
        action="store_false",
        help="do not predict and prefetch the next layer's experts",
    )
    g.add_argument(
        "--io",
        choices=("auto", "uring", "threads", "mmap"),
        default="auto",
        help="expert reader backend (default: io_uring if available, else threads)",
    )
    g.add_argument(
        "--threads",
        type=whole(0, "0: one per physical core"),
        default=0,
        help="kernel threads (default: physical cores)",
    )
    g.add_argument(
        "--ctx",
        dest="n_ctx",
        type=ctx_tokens,
        default=None,
        help=f"context length in tokens (default {DEFAULT_N_CTX}, or the model's maximum if less)",
    )
    g.add_argument(
        "--trace",
        metavar="FILE.npz",
        help="record every token's expert choice per layer (for `colibri replay`)",
    )
    g.add_argument(
        "--kv",
        dest="kv_dtype",
        choices=("f32", "f16"),
        default="f32",
        help="KV cache precision (default f32)",
    )
    g.add_argument(
        "--batch",
        choices=("split", "fused"),
        default="split",
        help="how concurrent sequences meet the kernels: split (default; per-sequence calls, "
        "the tokens of a solo run) or fused (rows stacked and padded to 4: one weight pass "
        "for all, tokens independent of the batch but not bit-equal to split's)",
    )
    g.add_argument(
        "--activations",
        choices=("f32", "q8_0", "q8_k"),
        default="q8_k",
        help="q8_k (default): as q8_0, but Q4_K/Q5_K/Q6_K experts run on Q8_K activations "
        "(llama.cpp's K-quant path; faster decode and prefill); q8_0: quantize activations to "
        "Q8_0 and use integer dot products for quantized weights, as llama.cpp does (faster, "
        "slightly less exact than f32); f32: exact f32 activations",
    )
    add_machine_options(g)
    c = p.add_argument_group("cluster (Ray; pip install 'colibri[cluster]')")
    c.add_argument(
        "--cluster",
        metavar="ADDRESS",
        default=None,
        help="run the routed experts on expert owners of this Ray cluster (auto: the running "
        "one; host:port); this process keeps attention, routing, the KV cache and sampling; "
        "--budget is then each owner's expert cache",
    )
    c.add_argument(
        "--owners-per-node",
        type=whole(1),
        default=1,
        help="expert owners (Ray actors) started on each node (default 1)",
    )
    c.add_argument(
        "--shard-map",
        metavar="FILE",
        default=None,
        help="which owner holds each expert and where its store is (`colibri shard` writes "
        "it; default: balanced over the nodes, each reading STORE at the same path)",
    )


def add_machine_options(g: Any) -> None:
    """--queue-depth and --no-profile (the machine profile written by `colibri tune`)."""
    g.add_argument(
        "--queue-depth",
        type=queue_depth,
        default=None,
        help="expert reads in flight at most (default: the profile's, else 32)",
    )
    g.add_argument(
        "--mirror",
        action="append",
        default=[],
        metavar="DIR",
        help="a copy of the experts file made by `colibri mirror` (repeatable): each record is "
        "read from one copy, spread by drive speed; a bad copy fails over to another",
    )
    g.add_argument(
        "--no-profile",
        action="store_true",
        help="ignore the machine profile of `colibri tune` (threads, queue depth, budget)",
    )


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=whole(1), default=128, help="tokens to generate")
    g.add_argument(
        "--temperature",
        "--temp",
        type=number(0, note="0 is greedy"),
        help="0 is greedy (default: the model's generation_config.json, else greedy)",
    )
    # the ranges SamplingParams checks (colibri/sampling.py)
    for flag, kind in (
        ("--top-k", whole(0, "0: off")),
        ("--top-p", number(0, 1, lo_open=True)),
        ("--min-p", number(0, 1)),
        ("--repetition-penalty", number(0, lo_open=True, note="1: off")),
        ("--presence-penalty", number(-2, 2)),
        ("--frequency-penalty", number(-2, 2)),
    ):
        g.add_argument(flag, type=kind, help="default: generation_config.json, else off")
    g.add_argument("--seed", type=whole(0), default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a store made by `colibri convert` (default: the embedded demo model)",
    )
    p.add_argument("-p", "--prompt", default=None, help="the prompt (default: a demo prompt)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat template as one user message",
    )
    add_sampling_options(p)
    add_engine_options(p)


def configure_chat_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="a store (default: the demo model)")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument(
        "--session",
        metavar="FILE",
        help="keep the conversation (tokens, KV cache, messages) in FILE, written after each "
        "answer; an existing FILE is resumed where it stopped",
    )
    add_sampling_options(p)
    add_engine_options(p)


ENGINE_OPTIONS = (
    "budget",
    "policy",
    "prefetch",
    "io",
    "threads",
    "n_ctx",
    "kv_dtype",
    "activations",
    "trace",
    "batch",
)
SAMPLING_OPTIONS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def check_ctx(engine: Engine, args: argparse.Namespace) -> None:
    """ColibriError when --ctx asked for more than the model's context length
    (max_position_embeddings), which the engine would silently use instead."""
    limit = engine.spec.max_position_embeddings
    if getattr(args, "n_ctx", None) is not None and args.n_ctx > limit:
        raise ColibriError(
            f"--ctx {args.n_ctx} exceeds the model's context length {limit} "
            "(max_position_embeddings)"
        )


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts = {k: getattr(args, k) for k in ENGINE_OPTIONS}
    if opts["n_ctx"] is None:
        opts["n_ctx"] = DEFAULT_N_CTX  # the engine clamps it to the model's maximum
    if getattr(args, "queue_depth", None) is not None:
        opts["queue_depth"] = args.queue_depth
    if getattr(args, "mirror", None):
        opts["mirrors"] = tuple(args.mirror)
    if getattr(args, "cluster", None):
        opts["cluster"] = args.cluster
        opts["owners_per_node"] = args.owners_per_node
        opts["shard_map"] = args.shard_map
    elif getattr(args, "shard_map", None):
        raise ColibriError("--shard-map needs --cluster ADDRESS")
    return opts


def engine_options(args: argparse.Namespace, path: Path) -> tuple[dict[str, Any], str]:
    """The engine options of the command line, with the machine profile's defaults (threads,
    queue depth, budget; colibri/machine.py) for those not given unless --no-profile.
    Returns (options, profile path or "" when none was used)."""
    opts = _engine_options(args)
    if getattr(args, "no_profile", False):
        return opts, ""
    from colibri.machine import load_profile, profile_budget, profile_defaults

    profile = load_profile()
    if profile is None:
        return opts, ""
    from colibri.io.format import open_store
    from colibri.plan import dense_resident_nbytes, kv_nbytes

    store = open_store(path)
    for k, v in profile_defaults(profile, store.experts_path).items():
        if not opts.get(k):
            opts[k] = v
    if opts["budget"] is None:
        experts = sum(r.nbytes for r in store.records)
        resident = dense_resident_nbytes(store)[0] + kv_nbytes(
            store, opts["n_ctx"], opts["kv_dtype"]
        )
        opts["budget"] = profile_budget(profile, experts, resident) or None
    if opts.get("mirrors"):
        from colibri.io.mirror import open_mirror

        files = [store.experts_path] + [open_mirror(store, d).experts_path for d in opts["mirrors"]]
        gbps = [profile.drive_gbps(f, opts.get("queue_depth") or 32) for f in files]
        if all(gbps):
            opts["mirror_weights"] = tuple(gbps)
    return opts, profile.path


def mirror_line(engine: Engine) -> str:
    """Per-copy read statistics of a mirrored reader ("" for a single copy)."""
    drives = getattr(engine.reader, "drive_statistics", None)
    if drives is None:
        return ""
    parts = [
        f"{d.path}: {d.reads} reads, {_mib(d.bytes_read)}, {d.gbps:.2f} GB/s, share "
        f"{d.weight:.0%}, {d.errors} read errors, {d.checksum_failures} checksum failures"
        for d in drives()
    ]
    return f"[mirror: {'; '.join(parts)}; {engine.reader.failovers} failovers]"


def cluster_line(engine: Engine) -> str:
    """Per-owner latency and bytes on the wire with --cluster ("" without)."""
    st = engine.statistics(components=False).cluster
    if st is None:
        return ""
    parts = [
        f"owner {o.index} @ {o.node}: {o.records} experts, {o.calls} calls, {o.mean_ms:.2f} ms "
        f"mean (max {o.max_ms:.1f}), busy {o.busy_ms:.2f} ms, {o.errors} errors, "
        f"{o.restarts} restarts"
        for o in st.owners
    ]
    wire = _mib(st.bytes_sent + st.bytes_received)
    return (
        f"[cluster: {st.layer_calls} layer calls, round trip {st.round_trip_ms:.2f} ms, "
        f"overhead {st.overhead_ms:.2f} ms, {wire} on the wire; {'; '.join(parts)}]"
    )


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options given on the command line (the rest come from the model)."""
    given = {k: getattr(args, k) for k in SAMPLING_OPTIONS} | {"stop": tuple(args.stop)}
    return {k: v for k, v in given.items() if v is not None}


def _model_path(args: argparse.Namespace) -> Path:
    return Path(args.model) if args.model else DEMO_STORE


def resident_memory() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out.get("VmRSS", 0), out.get("VmHWM", 0)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n < (1 << 30) else f"{n / (1 << 30):.2f} GiB"


def statistics_line(
    stats: GenerationStatistics, finish: str, io: str = "", profile: str = ""
) -> str:
    rss, peak = resident_memory()
    tok_s = f"{stats.decode_tok_s:.1f}" if stats.decode_tok_s >= 1 else f"{stats.decode_tok_s:.3f}"
    return (
        f"[{stats.prompt_tokens} prompt + {stats.generated_tokens} generated tokens, "
        f"{finish}; TTFT {stats.ttft * 1000:.0f} ms; {tok_s} tok/s; "
        f"hit rate {stats.hit_rate:.1%}; read {_mib(stats.bytes_read_per_token)}/token; "
        f"RSS {_mib(rss)} (peak {_mib(peak)}){'; io ' + io if io else ''}"
        f"{'; profile ' + profile if profile else ''}]"
    )


async def _print_stream(
    engine: Engine,
    prompt: Any,
    sampling: dict[str, Any],
    echo: str = "",
    profile: str = "",
    session: Any = None,
) -> str:
    """Stream one answer to stdout (after `echo`, printed once generation has started);
    returns its text. Ctrl-C (cancellation) ends it early."""
    text = []
    source = session if session is not None else engine
    async for tok in source.stream(prompt, **sampling):
        sys.stdout.write(echo + tok.text)
        echo = ""
        sys.stdout.flush()
        text.append(tok.text)
        if tok.statistics is not None:
            line = statistics_line(
                tok.statistics, tok.finish_reason or "", engine.reader.statistics().backend, profile
            )
            print("\n" + line, file=sys.stderr)
    return "".join(text)


def _say_backend(engine: Engine, requested: str, threads: int = 0) -> None:
    """One line on stderr when the reader is not the io_uring + O_DIRECT one asked for, and
    one when --threads asks for more threads than the kernels' pool has (physical cores)."""
    st = engine.reader.statistics()
    if (requested == "auto" and st.backend != "uring") or (st.backend != "mmap" and not st.direct):
        print(f"colibri: reading experts with {st.backend}: {st.reason}", file=sys.stderr)
    from colibri.compute import ops

    cores = ops.default_threads()
    if threads > cores:
        print(
            f"colibri: --threads {threads}: kernels run at most {cores} threads here (one per "
            "physical core, the size of their pool)",
            file=sys.stderr,
        )


async def _run(args: argparse.Namespace) -> int:
    path = _model_path(args)
    prompt: Any = check_utf8(args.prompt, "--prompt") if args.prompt is not None else DEMO_PROMPT
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    opts, profile = engine_options(args, path)
    async with open_engine(path, **opts) as engine:
        check_ctx(engine, args)
        _say_backend(engine, args.io, args.threads)
        echo = prompt if isinstance(prompt, str) else ""
        await _print_stream(engine, prompt, _sampling(args), echo, profile)
        for line in (mirror_line(engine), cluster_line(engine)):
            if line:
                print(line, file=sys.stderr)
    return 0


def run_cli(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _chat(args: argparse.Namespace) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    loop = asyncio.get_running_loop()
    # each turn resends the conversation: the prefix cache keeps the earlier turns' KV
    opts, profile = engine_options(args, _model_path(args))
    opts = {**opts, "prefix_cache": CHAT_PREFIX_CACHE}
    async with open_engine(_model_path(args), **opts) as engine:
        check_ctx(engine, args)
        _say_backend(engine, args.io, args.threads)
        session = None
        if args.session and Path(args.session).exists():
            session = engine.load_session(args.session)
            messages = session.messages
            print(
                f"colibri chat: resumed {args.session}: {len(messages)} messages, "
                f"{len(session.tokens)} tokens in the KV cache",
                file=sys.stderr,
            )
        elif args.session:
            session = engine.new_session(messages)
            messages = session.messages
        print(
            "colibri chat: empty line or Ctrl-D to quit, Ctrl-C stops an answer.", file=sys.stderr
        )
        while True:
            try:
                line = await loop.run_in_executor(None, input, "> ")
            except EOFError:
                break
            if not line.strip():
                break
            try:
                check_utf8(line, "input line")
            except TokenizerError as exc:
                print(f"colibri: error: {exc}; line ignored", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            task = asyncio.ensure_future(
                _print_stream(engine, messages, _sampling(args), profile=profile, session=session)
            )
            loop.add_signal_handler(signal.SIGINT, task.cancel)  # Ctrl-C stops this answer
            try:
                answer = await task
            except asyncio.CancelledError:
                answer = ""
                print("\n[stopped]", file=sys.stderr)
            finally:
                loop.remove_signal_handler(signal.SIGINT)
            messages.append({"role": "assistant", "content": answer})
            if session is not None:
                engine.save_session(args.session, session)
    return 0


def run_chat_cli(args: argparse.Namespace) -> int:
    return asyncio.run(_chat(args))
