"""Graceful drain on SIGTERM / SIGINT: stop admitting, let running requests finish, end the rest cleanly.

systemd, Docker and Kubernetes stop a service with SIGTERM (then SIGKILL after a grace period),
so a restart must not cut answers off mid-stream. On the first signal the server

1. stops admitting: a new request gets a 503 JSON error with ``Retry-After`` and
   ``Connection: close``; ``/health`` answers 503 ``{"status": "draining"}`` so load balancers
   take the instance out (``/metrics`` and ``/version`` keep answering);
2. lets the requests it has (streams and not) run on for up to ``--shutdown-timeout`` seconds;
3. ends what is left through the engine: a stream gets a final OpenAI-style error event and
   ``data: [DONE]``, a request without a response yet a 503 JSON error;
4. then tells uvicorn to exit: no request is left for it to cancel, so there are no tracebacks,
   and ``specserve serve`` exits 0.

A second signal ends the running requests at once (step 3, still clean endings); a third one
stops waiting for their responses to go out.

``Drain`` holds the state and runs in the HTTP event loop (signals reach it through the signal
module's wakeup socket, or ``request()`` from any thread); ``DrainMiddleware`` is the ASGI layer
in front of the app that refuses, counts the requests in flight and attaches the drain to the
event loop at lifespan start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
from typing import Callable

from starlette.responses import JSONResponse

from specserve.errors import ServiceUnavailable
from specserve.server.protocol import error_body

logger = logging.getLogger("specserve.server")

RETRY_AFTER_S = 5  # what a refused client is told: time enough for a restart or another instance
END_GRACE_S = 2.0  # after the engine ended the requests left, how long their last bytes may take
PASS_PATHS = frozenset({"/metrics", "/version"})  # still answered while draining (scrapers, probes)
SHUTTING_DOWN = "the server is shutting down"


def unavailable_body(message: str = SHUTTING_DOWN) -> dict:
    """An OpenAI-style error body for a 503 (also a stream's final error event)."""
    return error_body(message, "server_error", code="server_shutting_down")


def unavailable_response(exc: ServiceUnavailable) -> JSONResponse:
    return JSONResponse(unavailable_body(str(exc)), status_code=503,
                        headers={"retry-after": str(RETRY_AFTER_S)})


class Drain:
    """Shutdown state of one server.

    ``fail_all(exc)`` ends every engine request with ``exc`` (AsyncEngine.fail_all, thread-safe);
    ``on_done(force)`` asks the HTTP server to exit (force: without waiting for connections).
    ``request()`` can be called from any thread; ``listen()`` takes signals straight from the
    signal module's wakeup socket instead. Everything else runs in the event loop that ``attach``
    names.
    """

    def __init__(self, timeout_s: float, fail_all: Callable[[BaseException], None],
                 on_done: Callable[[bool], None], clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self.fail_all, self.on_done, self.clock = fail_all, on_done, clock
        self.draining = False
        self.inflight = 0
        self.deadline = 0.0
        self.signals = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._signals_in: socket.socket | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.loop is None:
            self.loop, self._wake = loop, asyncio.Event()
            if self._signals_in is not None:
                loop.add_reader(self._signals_in.fileno(), self._read_signals)

    def listen(self, sock: socket.socket) -> None:
        """Take signals from ``sock``, the non-blocking read end of the socket given to
        ``signal.set_wakeup_fd`` (call before the event loop starts). The C-level handler writes a
        signal's number there as it arrives, so the drain starts (and a second signal ends the
        requests) even while the main thread is inside a long forward pass, where a Python signal
        handler would wait for the pass to end."""
        self._signals_in = sock

    def _read_signals(self) -> None:
        try:
            data = self._signals_in.recv(512)
        except (BlockingIOError, InterruptedError):
            return
        for signum in data:
            self.signals += 1
            self._on_request(self.signals, _signal_name(signum))

    def request(self, signum: int | None = None) -> None:
        """Begin the drain (first call), end the requests now (second), stop waiting (third)."""
        self.signals += 1
        count, name = self.signals, _signal_name(signum)
        loop = self.loop
        if loop is None or loop.is_closed():  # not serving yet (or any more): nothing to drain
            self.on_done(count > 1)
            return
        loop.call_soon_threadsafe(self._on_request, count, name)

    # ---- event loop ------------------------------------------------------------------------
    def enter(self) -> None:
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _on_request(self, count: int, name: str) -> None:
        now = self.clock()
        if count == 1:
            self.draining = True
            self.deadline = now + self.timeout_s
            logger.warning("%s: draining, not admitting new requests; %d in flight may run for up to %g s "
                           "(--shutdown-timeout); a second signal ends them now", name, self.inflight,
                           self.timeout_s)
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif count == 2:
            logger.warning("%s again: ending the %d request(s) in flight now", name, self.inflight)
            self.deadline = min(self.deadline, now)
            self._poke()
        else:
            logger.warning("%s a third time: exiting without waiting for responses", name)
            self.on_done(True)

    async def _run(self) -> None:
        await self._until_idle(lambda: self.deadline)
        if self.inflight:
            logger.warning("shutdown: ending %d request(s) still in flight (503 / a final stream error)",
                           self.inflight)
            self.fail_all(ServiceUnavailable(SHUTTING_DOWN))
            end = self.clock() + END_GRACE_S
            await self._until_idle(lambda: end)
            if self.inflight:
                logger.warning("shutdown: %d response(s) still open after %g s; closing them", self.inflight,
                               END_GRACE_S)
        logger.info("drained: shutting down")
        self.on_done(False)

    async def _until_idle(self, deadline: Callable[[], float]) -> None:
        """Until nothing is in flight or deadline() has passed (it may move earlier meanwhile)."""
        while self.inflight:
            left = deadline() - self.clock()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                pass


def _signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name if signum is not None else "shutdown"
    except ValueError:
        return f"signal {signum}"


class DrainMiddleware:
    """Outermost ASGI layer: refuses requests while draining and counts the ones in flight."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind in ("lifespan", "http"):
            self.drain.attach(asyncio.get_running_loop())
        if kind != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path")
        if self.drain.draining and path not in PASS_PATHS:
            if path in ("/health", "/v1/health"):
                return await _send_json(send, 503, {"status": "draining"})
            return await _send_json(send, 503, unavailable_body(f"{SHUTTING_DOWN}: not accepting new requests"),
                                    [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")])
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


async def _send_json(send, status: int, obj: dict, headers: list | None = None) -> None:
    body = json.dumps(obj).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw + (headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})
