"""The engine as the server sees it: requests in, streams of deltas out.

The step loop owns the :class:`LLMEngine`; requests and aborts reach it through a queue, and
its outputs go back to each request's asyncio queue. The forward pass releases the GIL, so the
event loop keeps serving HTTP. By default the loop runs in a background thread started with the
app; ``specserve serve`` instead runs it in the main thread (:meth:`AsyncEngine.run_forever`)
and the HTTP server in a second one: the OpenMP kernels run much slower when stepped from a
thread other than the one that built the model (benchmarks/engine_thread.py: 148 vs 81 tok/s).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import EngineStats, RequestOutput, SamplingParams
from specserve.parallel.group import ParallelError

log = logging.getLogger("specserve.engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str, own_thread: bool = True):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.spec_enabled = engine.speculative is not None
        self.max_num_seqs = engine.ecfg.max_num_seqs
        self._inbox: queue.Queue = queue.Queue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = engine.stats()
        self._own_thread = own_thread  # False: the caller runs run_forever() itself
        self._closed: BaseException | None = None  # set by fail_all: every request ends with it
        self.fatal: BaseException | None = None  # the engine cannot go on (a tensor-parallel rank is gone)

    @classmethod
    def from_args(cls, args: argparse.Namespace, own_thread: bool = True) -> "AsyncEngine":
        from specserve.engine.builder import build_engine

        engine = build_engine(args)
        return cls(engine, engine.target.name, own_thread)  # (the names it is served under: ServerConfig)

    def run_forever(self, keep_going=lambda: True) -> None:
        """Run the step loop in the calling thread until shutdown() or keep_going() is false."""
        while keep_going() and not self._stop.is_set() and self.fatal is None:
            self._step_once()

    async def start(self) -> None:
        if self._own_thread and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None

    def stats(self) -> EngineStats:
        return self._stats

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def fail_all(self, exc: BaseException) -> None:
        """End every request with ``exc`` (raised from its generate()), and every later one at once:
        the end of a shutdown drain. Call it from the event loop that runs the requests: their
        streams end now, without waiting for the step in progress; the step loop then drops their
        sequences (the aborts their generators send, and the "fail" below for any not yet seen)."""
        self._closed = exc
        for loop, q in list(self._queues.values()):
            loop.call_soon_threadsafe(q.put_nowait, exc)
        self._inbox.put(("fail", exc))

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        self.engine.validate(prompt_ids, params)  # raises RequestError before anything is queued
        if images:
            self.engine.place_images(prompt_ids, images)  # the same, for the image placeholders
        if self._closed is not None:
            raise self._closed
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, q)
        self._inbox.put(("add", (request_id, list(prompt_ids), params, images)))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set() and self.fatal is None:
            self._step_once()

    def _step_once(self) -> None:
        eng = self.engine
        self._drain(block=not eng.has_work())
        try:
            if not eng.has_work():
                eng.idle()
                return
            rows = eng.schedule_step()
            self._stats = eng.stats()  # admitted and reserved: running while its forward computes
            outputs = eng.run_step(rows) if rows else []
        except ParallelError as exc:  # the group is broken for good: fail everything, stop
            log.error("%s: failing every request and stopping", exc)
            self.fatal = self._closed = exc
            self._fail_all(exc)
            return
        except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
            log.exception("engine step failed")
            self._fail_all(exc)
            return
        self._stats = eng.stats()
        for out in outputs:
            self._send(out.request_id, out)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._stats = self.engine.stats()

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            rid, ids, params, images = payload
            if self._closed is not None:  # queued after fail_all: never started
                self._send(rid, self._closed)
                return
            try:
                self.engine.add_request(rid, ids, params, images)
            except Exception as exc:  # noqa: BLE001
                self._send(rid, exc)
        elif kind == "abort":
            out = self.engine.abort(payload)
            if out is not None:
                self._send(payload, out)
        elif kind == "fail":
            self._fail_all(payload)

    def _send(self, request_id: str, item) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        for seq in list(self.engine.running) + list(self.engine.waiting):
            self.engine.abort(seq.request_id)
            self._send(seq.request_id, exc)
