"""A colibri server on 127.0.0.1 in a background thread, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx

DEMO = Path(__file__).resolve().parents[1] / "colibri" / "data" / "demo"
# ../shared/data beside the checkout, as tests/hf_models.py (without importing torch)
SHARED = Path(
    os.environ.get("COLIBRI_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Opens an engine on `store` and serves it; `url`, `service` once started."""

    def __init__(
        self,
        store: Path = DEMO,
        *,
        engine_options: dict[str, Any] | None = None,
        max_body_bytes: int | None = None,
        **service_options: Any,
    ) -> None:
        self.store, self.port = store, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        parallel = service_options.get("parallel", 4)
        self.engine_options = {"io": "threads", "max_running": parallel, **(engine_options or {})}
        self.service_options, self.max_body_bytes = service_options, max_body_bytes
        self.server: Any = None
        self.service: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        import uvicorn

        from colibri.engine import open_engine
        from colibri.serve import Service, create_app

        self.loop = asyncio.get_running_loop()
        async with open_engine(self.store, **self.engine_options) as engine:
            self.service = Service(engine, "colibri-demo", **self.service_options)
            kw = {} if self.max_body_bytes is None else {"max_body_bytes": self.max_body_bytes}
            config = uvicorn.Config(
                create_app(self.service, **kw),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="off",
            )
            self.server = uvicorn.Server(config)
            task = asyncio.ensure_future(self.server.serve())
            while not self.server.started and not task.done():
                await asyncio.sleep(0.01)
            self._ready.set()
            await task

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(30)

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """/health once nothing runs, waits, is leased or read (or the last one seen)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            idle = h["running"] == 0 and h["waiting"] == 0 and h["leased"] == 0
            if (idle and h["reads_in_flight"] == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)


@contextlib.contextmanager
def running_server(**kw: Any) -> Iterator[ServerThread]:
    srv = ServerThread(**kw).start()
    try:
        yield srv
    finally:
        srv.stop()
