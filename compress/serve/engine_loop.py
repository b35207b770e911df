"""One background thread that owns the :class:`~llmopt.runtime.LLMEngine` and steps it.

Everything that touches the engine or its tokenizer runs in that thread: request handlers send
it commands (add, abort, any function of the engine) through a queue and get results back as
awaitables; after every step each request's new tokens and text go to its own asyncio queue.
An abort is handled before the next step, so a cancelled request's KV blocks are free at once.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from llmopt.runtime import LLMEngine, RequestOutput, SamplingParams


@dataclass
class Chunk:
    """What one step added to one sequence, as the HTTP layer needs it."""

    delta_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[dict] | None = None  # per new token: {"token", "logprob", "top": [(token, logprob), …]}
    metrics: Any = None
    error: str | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    params: SamplingParams
    request_id: str
    shown: str = ""
    num_logprobs: int = 0  # logprob entries already sent


class EngineLoop:
    """``await submit_many(add, ids, queue, params)``: chunks of those sequences go to ``queue``;
    ``abort(rid)``; ``call(fn)`` runs ``fn(engine)`` in the engine thread."""

    def __init__(self, engine: LLMEngine, idle_wait: float = 0.5) -> None:
        self.engine = engine
        self.idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmopt-engine", daemon=True)
        self.snapshot: dict = self._snapshot()
        self.steps = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, end the thread and wait for it."""
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def pause(self) -> None:
        """Stop stepping (commands are still handled): requests queue up without progressing."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._commands.put(None)

    # -- API for request handlers (any thread / event loop) ----------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        future: Future = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def submit_many(self, add: Callable[[LLMEngine], Any], request_ids: list[str], out: asyncio.Queue,
                          params: list[SamplingParams]) -> Any:
        """Run ``add(engine)`` (which queues ``request_ids`` in the engine, or raises) in the engine
        thread; from then on each sequence's chunks arrive on ``out`` as ``(request_id, Chunk)``
        (the last one has ``finished``). Returns what ``add`` returned."""
        loop = asyncio.get_running_loop()

        def run(engine: LLMEngine) -> Any:
            result = add(engine)
            for rid, p in zip(request_ids, params):
                self._streams[rid] = _Stream(loop, out, p, rid)
            return result

        return await self.call(run)

    def abort(self, request_id: str) -> None:
        """Abort (fire and forget): the blocks are freed before the next step."""
        self._commands.put((lambda engine: self._abort(request_id), None))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            busy = engine.has_unfinished() and not self._paused.is_set()
            self._drain(block=not busy)
            if self._stop.is_set():
                break
            if engine.has_unfinished() and not self._paused.is_set():
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001 - fail what is running, keep serving
                    outputs = []
                    self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                self.steps += 1
                self._publish(outputs)
            self.snapshot = self._snapshot()
        for rid in list(self._streams):
            self._abort(rid)
        self.snapshot = self._snapshot()

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self.idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                fn, future = item
                try:
                    result = fn(self.engine)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    if future is not None:
                        future.set_exception(exc)
                else:
                    if future is not None:
                        future.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id, report=False)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._deliver(stream, Chunk("", [], True, "abort"))

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid, report=False)
            self._deliver(stream, Chunk("", [], True, "error", error=message))
        self._streams.clear()

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            chunk = self._chunk(stream, out)
            if out.finished:
                self._streams.pop(out.request_id, None)
            by_loop.setdefault(stream.loop, []).append((stream.queue, (stream.request_id, chunk)))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _deliver(self, stream: _Stream, chunk: Chunk) -> None:
        _call_soon(stream.loop, _put_all, [(stream.queue, (stream.request_id, chunk))])

    def _chunk(self, stream: _Stream, out: RequestOutput) -> Chunk:
        text = out.text
        if not out.finished:
            text = text.rstrip("\ufffd")  # wait for whole characters
            text = text[:len(text) - _held_back(text, stream.params.stop)]  # could still become a stop string
        common = len(os.path.commonprefix([stream.shown, text]))
        delta = text[common:]
        stream.shown = text
        logprobs = None
        if out.logprobs is not None and len(out.logprobs) > stream.num_logprobs:
            logprobs = []
            ids = out.token_ids
            for i in range(stream.num_logprobs, len(out.logprobs)):
                entry = out.logprobs[i]
                token = ids[i]
                top = sorted(entry.items(), key=lambda kv: -kv[1])[: stream.params.logprobs]
                logprobs.append({"token": self._piece(token), "token_id": token, "logprob": entry[token],
                                 "top": [(self._piece(t), lp) for t, lp in top]})
            stream.num_logprobs = len(out.logprobs)
        return Chunk(delta, list(out.new_token_ids), out.finished, out.finish_reason, len(out.prompt_token_ids),
                     len(out.token_ids), logprobs, out.metrics if out.finished else None, out.error)

    def _piece(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _snapshot(self) -> dict:
        engine = self.engine
        stats = engine.metrics()
        stats.update(running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting), time=time.time())
        return stats


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``stops`` (not sent yet)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass
