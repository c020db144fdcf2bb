"""Running a request's choices on the engine, merging their streams, SSE, disconnects.

Each choice is its own engine request, pumped by its own task into one queue.
Closing the fan-out cancels those tasks; the cancellation reaches the engine's
generator, which aborts the sequence and frees its KV blocks. A client that
disconnects (streaming or not) closes the fan-out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response

from specserve.engine.types import RequestOutput, SamplingParams, AcceptanceStats, TokenLogprob
from specserve.server.metrics import ServerMetrics

logger = logging.getLogger("specserve.server")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


@dataclass
class Choice:
    """One engine request and what it produced so far."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: once the prompt is computed
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    acceptance: AcceptanceStats | None = None
    prefill_time: float = 0.0
    decode_time: float = 0.0
    images: list = field(default_factory=list)  # ImageInput of the prompt's placeholder runs (engine/multimodal.py)

    def absorb(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.prompt_tokens = out.prompt_tokens or len(self.prompt_ids)
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.acceptance = out.acceptance
        self.prefill_time = out.prefill_time
        self.decode_time = out.decode_time


def log_finished(choice: Choice, before_output: bool = False) -> None:
    if before_output:  # gone during its prefill: no tokens or speeds to report
        logger.info("request %s: prompt %d tok, aborted before its first token", choice.request_id,
                    len(choice.prompt_ids))
        return
    pre = choice.prompt_tokens / choice.prefill_time if choice.prefill_time > 0 else 0.0
    dec = choice.completion_tokens / choice.decode_time if choice.decode_time > 0 else 0.0
    line = (f"request {choice.request_id}: prompt {choice.prompt_tokens} tok (cached {choice.cached_tokens}), "
            f"completion {choice.completion_tokens} tok, prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s, "
            f"finish {choice.finish_reason or 'abort'}")
    if choice.acceptance is not None:
        line += f"; {choice.acceptance.line()}"
    logger.info(line)


STREAM_HEADERS_AFTER = 0.5  # seconds a stream waits for its first outputs before sending its headers


class Fanout:
    """Runs choices concurrently; iterate to get (choice, output) in arrival order."""

    def __init__(self, engine, metrics: ServerMetrics, choices: list[Choice]):
        self.engine = engine
        self.metrics = metrics
        self.choices = choices
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffer: list[tuple[Choice, RequestOutput | None, BaseException | None]] = []

    async def start(self, within: float | None = None) -> None:
        """Submit every choice and wait until each produced its first output, or ``within`` seconds
        passed (None: no limit).

        An engine error raised before then (the engine's checks of a request, e.g. a prompt too
        long for the KV pool, come at once) is raised here, before any response is sent; a stream
        that starts without waiting out a long prefill reports a later error in its events.
        """
        self._tasks = [asyncio.create_task(self._pump(c)) for c in self.choices]
        pending = {c.index for c in self.choices}
        deadline = None if within is None else asyncio.get_running_loop().time() + within
        while pending:
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if left is not None and left <= 0:
                return
            try:
                item = await asyncio.wait_for(self._queue.get(), left)
            except asyncio.TimeoutError:
                return
            self._buffer.append(item)
            choice, _out, exc = item
            if exc is not None:
                await self.close()
                raise exc
            pending.discard(choice.index)

    async def __aiter__(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        remaining = len(self.choices)
        while remaining:
            choice, out, exc = self._buffer.pop(0) if self._buffer else await self._queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
                continue
            yield choice, out

    async def drain(self) -> None:
        async for _ in self:
            pass

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    def stop(self, choice: Choice) -> None:
        """End one choice now (the engine aborts it); iterating goes on with the others."""
        self._tasks[self.choices.index(choice)].cancel()

    async def close(self) -> None:
        """Cancel unfinished choices (the engine aborts them) and wait until they are gone."""
        self.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _pump(self, choice: Choice) -> None:
        tracker = self.metrics.tracker()
        gen = self.engine.generate(choice.prompt_ids, choice.params, choice.request_id,
                                   **({"images": choice.images} if choice.images else {}))
        cancelled = False
        try:
            async for out in gen:
                choice.absorb(out)
                tracker.on_output(out)
                self._queue.put_nowait((choice, out, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((choice, None, exc))
            return
        except asyncio.CancelledError:  # stopped (stop, close): the consumer counts it as ended
            cancelled = True
            self._queue.put_nowait((choice, None, None))
            raise
        finally:
            with contextlib.suppress(Exception):
                await gen.aclose()
            if tracker.last is not None or cancelled:  # (not a request the engine refused before any output)
                log_finished(choice, before_output=tracker.last is None)
                tracker.finish(choice.finish_reason)
        self._queue.put_nowait((choice, None, None))


async def run_or_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it and raise ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone()


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """Server-sent events that stop (and close the fan-out) as soon as the client disconnects.

    Starlette's StreamingResponse only watches for disconnects on some ASGI
    spec versions; this one always does.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})  # no body: no length
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    await self._stream(send)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await _until_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()
            await self.on_close()

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def start_fanout(receive: Callable[[], Awaitable[dict]], fan: Fanout, drain: bool, stream: bool = False) -> None:
    """Start the choices (and, for a non-streaming response, run them to the end).

    Engine errors before the first output propagate (as 4xx/5xx before any
    byte is sent); a disconnect raises ClientGone. Either way nothing is left
    running. A drained fan-out is closed; a streaming one is closed by the
    SSEResponse. A stream (``stream``) starts after at most STREAM_HEADERS_AFTER
    seconds, as vLLM's sends its headers at once: a long prompt's prefill or a
    queue does not hold back the status line past a client's or a proxy's
    first-byte timeout.
    """
    try:
        await run_or_disconnect(receive, fan.start(STREAM_HEADERS_AFTER if stream else None))
        if drain:
            await run_or_disconnect(receive, fan.drain())
    except BaseException:
        await fan.close()
        raise
    if drain:
        await fan.close()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
