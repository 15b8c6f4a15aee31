"""`colibri serve [STORE]`: the HTTP server (the embedded demo model when STORE is omitted).

    colibri serve                      # demo model on http://127.0.0.1:8000
    colibri serve store/ --port 8080 --parallel 4 --api-key KEY --budget 8G

Engine options are those of `colibri run`. The event loop is uvloop's when installed.
SIGTERM or Ctrl-C: stop accepting connections, let running requests finish (at most
--drain-timeout seconds), close the engine, print one statistics line, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from colibri.options import number, positive_size, whole
from colibri.run import (
    DEMO_STORE,
    _say_backend,
    add_engine_options,
    check_ctx,
    engine_options,
    size_arg,
)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a store made by `colibri convert` (default: the embedded demo model)",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    g.add_argument(
        "--parallel",
        type=whole(1),
        default=4,
        help="sequences decoded together (default 4); more requests wait in the queue",
    )
    g.add_argument(
        "--max-queue",
        type=whole(0),
        default=64,
        help="requests that may wait for a sequence; beyond, 429 with Retry-After (default 64)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("COLIBRI_API_KEY"),
        help="require `Authorization: Bearer KEY` (or x-api-key) on /v1 (default: "
        "$COLIBRI_API_KEY, else none)",
    )
    g.add_argument(
        "--name", default=None, help="the model id clients use (default: the store's folder name)"
    )
    g.add_argument(
        "--max-body", type=positive_size, default="32M", help="largest request body (default 32M)"
    )
    g.add_argument(
        "--prefix-cache",
        type=size_arg,
        default="1G",
        help="RAM for the KV of prompt prefixes reused by later requests (default 1G; 0: off)",
    )
    g.add_argument(
        "--drain-timeout",
        type=number(0),
        default=60.0,
        help="seconds running requests get to finish on SIGTERM (default 60)",
    )
    g.add_argument(
        "--atlas-trace",
        default=None,
        metavar="FILE",
        help="a routing trace (.npz from --trace or `colibri replay`) the dashboard's atlas "
        "starts from (default: only the routing of this session)",
    )
    add_engine_options(p)


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's Server, but SIGINT/SIGTERM only start the graceful shutdown: uvicorn
        re-raises the signal once serve() returns, which would kill the process before the
        engine is closed and the statistics line printed."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            sigs = (signal.SIGINT, signal.SIGTERM)
            for sig in sigs:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in sigs:
                    loop.remove_signal_handler(sig)

    return Server


def _port(text: str) -> int:
    """--port for argparse: an integer 0..65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {text!r} (0..65535)")
    return port


def _check_address(host: str, port: int) -> None:
    """ColibriError naming host:port when it cannot be bound (in use, or not an address
    here), before the engine loads, instead of uvicorn's traceback after."""
    import socket

    from colibri.errors import ColibriError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ColibriError(f"{host}:{port}: cannot listen there ({why}; --host / --port)") from None


def model_id(path: Path, name: str | None) -> str:
    if name:
        return name
    return "colibri-demo" if path == DEMO_STORE else path.resolve().name


async def serve(args: argparse.Namespace, on_started: Callable[[str], None] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; on_started(url) is called once it listens."""
    import uvicorn

    _check_address(args.host, args.port)

    from colibri.engine import open_engine
    from colibri.serve.app import create_app
    from colibri.serve.service import Service

    _Server = _server_class()
    path = Path(args.model) if args.model else DEMO_STORE
    opts, _profile = engine_options(args, path)  # the machine profile's defaults (colibri tune)
    options = {
        **opts,
        "max_running": args.parallel,
        "prefix_cache": args.prefix_cache,
    }
    async with open_engine(path, **options) as engine:
        check_ctx(engine, args)
        _say_backend(engine, args.io, args.threads)
        service = Service(
            engine,
            model_id(path, args.name),
            parallel=args.parallel,
            max_queue=args.max_queue,
            api_key=args.api_key,
        )
        config = uvicorn.Config(
            create_app(
                service,
                max_body_bytes=args.max_body,
                atlas_trace=getattr(args, "atlas_trace", None),
            ),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=args.drain_timeout,
            lifespan="off",
        )
        server = _Server(config)
        print(
            f"colibri serve: {service.model_id} on http://{args.host}:{args.port} "
            f"({args.parallel} parallel{', API key required' if args.api_key else ''})",
            file=sys.stderr,
            flush=True,
        )
        task = asyncio.ensure_future(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started and on_started is not None:
            on_started(f"http://{args.host}:{args.port}/")
        await task
        s = engine.statistics()
    print(
        f"colibri serve: stopped; {s.prompt_tokens} prompt + {s.generated_tokens} generated "
        f"tokens; running {s.running}; leased {s.leased}; reads in flight "
        f"{s.reads_in_flight}",
        file=sys.stderr,
        flush=True,
    )
    return 0


def run_cli(args: argparse.Namespace, on_started: Callable[[str], None] | None = None) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(args, on_started))
    return uvloop.run(serve(args, on_started))
