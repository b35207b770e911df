"""One background thread that owns the :class:`~llmopt.runtime.LLMEngine` and steps it.

Everything that touches the engine or its tokenizer runs in that thread: request handlers send
it commands (add, abort, any function of the engine) through a queue and get results back as
awaitables; after every step each request's new tokens and text go to its own asyncio queue.
An abort is handled before the next step, so a cancelled request's KV blocks are free at once.

Supervision (vLLM's rule): the whole loop is guarded. An error that belongs to one sequence
(producing its output: detokenization, logprob formatting) fails that sequence alone. Any other
unexpected error fails the requests it may have touched (the running ones, and any whose output
was lost) with an error chunk, frees their KV blocks and the loop carries on; a second error in a
row fails everything in flight. ``error_limit`` errors in a row with no good step between, or an
error while recovering, mark the engine dead: everything in flight fails, later calls raise
:class:`EngineDead`, ``healthy`` turns false and ``on_dead`` is called. The slot a request holds
is released by ``on_finish``, called on the request's event loop as soon as the engine finishes
it, whether or not anyone reads the chunk.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from llmopt.runtime import LLMEngine, RequestOutput, SamplingParams

log = logging.getLogger("llmopt.serve")


class EngineDead(RuntimeError):
    """The engine loop has stopped for good (a repeated or fatal error, or shutdown)."""


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
    prompt_logprobs: list[dict] | None = None  # once, with the first token: per prompt token (the first has logprob None)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    params: SamplingParams
    request_id: str
    on_finish: Callable[[str, Chunk], None] | None = None  # on the event loop, when the engine finishes it
    num_logprobs: int = 0  # logprob entries already sent
    prompt_sent: bool = False  # prompt log-probabilities already sent


class EngineLoop:
    """``await submit_many(add, ids, queue, params)``: chunks of those sequences go to ``queue``;
    ``abort(rid)``; ``call(fn)`` runs ``fn(engine)`` in the engine thread."""

    def __init__(self, engine: LLMEngine, idle_wait: float = 0.5, error_limit: int = 3,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.idle_wait = idle_wait
        self.error_limit = max(1, error_limit)
        self.on_dead = on_dead
        self.dead: str | None = None  # why the engine stopped for good
        self.errors = 0  # unexpected errors survived or not, since start
        self._errors_in_a_row = 0
        self._closed = False  # no command will be handled any more (dead or stopped)
        self._lock = threading.Lock()  # orders command submission against closing
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

    @property
    def healthy(self) -> bool:
        """The engine thread runs and has not been marked dead."""
        return self.dead is None and self._thread.is_alive() and not self._closed

    # -- API for request handlers (any thread / event loop) ----------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result; raises
        :class:`EngineDead` once the loop has stopped."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise EngineDead(self.dead or "the engine has stopped")
            self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def submit_many(self, add: Callable[[LLMEngine], Any], request_ids: list[str], out: asyncio.Queue,
                          params: list[SamplingParams], on_finish: Callable[[str, Chunk], None] | None = None) -> Any:
        """Run ``add(engine)`` (which queues ``request_ids`` in the engine, or raises) in the engine
        thread; from then on each sequence's chunks arrive on ``out`` as ``(request_id, Chunk)``
        (the last one has ``finished``), and ``on_finish(request_id, last chunk)`` is called on
        this event loop when the engine is done with it. Returns what ``add`` returned."""
        loop = asyncio.get_running_loop()

        def run(engine: LLMEngine) -> Any:
            result = add(engine)
            for rid, p in zip(request_ids, params):
                self._streams[rid] = _Stream(loop, out, p, rid, on_finish)
            return result

        return await self.call(run)

    def abort(self, request_id: str) -> None:
        """Abort (fire and forget): the blocks are freed before the next step."""
        with self._lock:
            if not self._closed:
                self._commands.put((lambda engine: self._abort(request_id), None))

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.dead is None:
                try:
                    self._iteration()
                except Exception as exc:  # noqa: BLE001 - supervised: fail what it touched, carry on or die
                    self._recover(exc)
        except BaseException as exc:  # noqa: BLE001 - never leave requests hanging on a dead thread
            self._die(f"engine loop crashed: {type(exc).__name__}: {exc}")
            raise
        finally:
            self._close()

    def _iteration(self) -> None:
        engine = self.engine
        busy = engine.has_unfinished() and not self._paused.is_set()
        self._drain(block=not busy)
        if self._stop.is_set():
            return
        if engine.has_unfinished() and not self._paused.is_set():
            try:
                outputs = engine.step()
            finally:
                self.steps += 1
            self._publish(outputs)
            self._errors_in_a_row = 0
        self._refresh_snapshot()

    def _recover(self, exc: Exception) -> None:
        """After an unexpected error: fail the requests it may have touched (the running ones and
        any the engine no longer knows, whose last output was lost; on a second error in a row
        everything), free their blocks and carry on, or die when errors keep coming."""
        self.errors += 1
        self._errors_in_a_row += 1
        message = f"engine error: {type(exc).__name__}: {exc}"
        log.error("%s (%d in a row)", message, self._errors_in_a_row, exc_info=exc)
        if self._errors_in_a_row >= self.error_limit:
            self._die(f"{message} ({self._errors_in_a_row} errors in a row)")
            return
        try:
            if self._errors_in_a_row == 1:
                waiting = {seq.request_id for seq in self.engine.scheduler.waiting}
                victims = [rid for rid in self._streams if rid not in waiting]
            else:
                victims = list(self._streams)
            for rid in victims:
                self._fail(rid, message)
            self._refresh_snapshot()
        except Exception as again:  # noqa: BLE001 - the engine cannot be trusted any more
            log.error("recovering from the engine error failed", exc_info=again)
            self._die(f"{message}; recovering failed: {type(again).__name__}: {again}")

    def _fail(self, request_id: str, message: str) -> None:
        """Finish one request with an error: free its blocks, send its last chunk."""
        stream = self._streams.pop(request_id, None)
        try:
            self.engine.abort(request_id, report=False)
        finally:
            if stream is not None:
                self._deliver(stream, Chunk("", [], True, "error", error=message))

    def _die(self, message: str) -> None:
        """Mark the engine dead: fail everything in flight and every pending command."""
        if self.dead is not None:
            return
        self.dead = message
        log.critical("the engine is dead: %s", message)
        for rid in list(self._streams):
            try:
                self._fail(rid, f"the engine failed: {message}")
            except Exception:  # noqa: BLE001 - the error chunk went out; the blocks go with the engine
                pass
        self._close()
        if self.on_dead is not None:
            try:
                self.on_dead(message)
            except Exception:  # noqa: BLE001
                log.exception("on_dead failed")

    def _close(self) -> None:
        """No command will be handled from now on: refuse queued ones (or, on a normal stop,
        abort what is left)."""
        with self._lock:
            self._closed = True
        reason = EngineDead(self.dead or "the engine has stopped")
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[1] is not None and not item[1].done():
                item[1].set_exception(reason)
        for rid in list(self._streams):
            try:
                if self.dead is None:
                    self._abort(rid)
                else:
                    self._fail(rid, f"the engine failed: {self.dead}")
            except Exception:  # noqa: BLE001 - shutting down
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self._deliver(stream, Chunk("", [], True, "abort"))
        try:
            self.snapshot = self._snapshot()
        except Exception:  # noqa: BLE001
            pass

    def _refresh_snapshot(self) -> None:
        """Metrics for /metrics; a failure keeps the previous ones and serving goes on."""
        try:
            self.snapshot = self._snapshot()
        except Exception as exc:  # noqa: BLE001 - metrics must not stop the engine
            if self.steps % 1000 == 0 or "snapshot_error" not in self.snapshot:
                log.error("engine metrics failed: %s: %s", type(exc).__name__, exc)
            self.snapshot = {**self.snapshot, "snapshot_error": f"{type(exc).__name__}: {exc}"}

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
                    elif not isinstance(exc, Exception):
                        raise
                    else:
                        log.error("engine command failed: %s: %s", type(exc).__name__, exc)
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

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        try:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                try:
                    chunk = self._chunk(stream, out)
                except Exception as exc:  # noqa: BLE001 - this sequence's output failed: fail it alone
                    self.errors += 1
                    message = f"producing the output failed: {type(exc).__name__}: {exc}"
                    log.error("request %s: %s", out.request_id, message, exc_info=exc)
                    self._streams.pop(out.request_id, None)
                    by_loop.setdefault(stream.loop, []).append((stream, Chunk("", [], True, "error", error=message)))
                    self.engine.abort(out.request_id, report=False)
                    continue
                if chunk.finished:
                    self._streams.pop(out.request_id, None)
                by_loop.setdefault(stream.loop, []).append((stream, chunk))
        finally:  # what was produced goes out even if a later output fails the whole step
            for loop, items in by_loop.items():
                _call_soon(loop, _put_all, items)

    def _deliver(self, stream: _Stream, chunk: Chunk) -> None:
        _call_soon(stream.loop, _put_all, [(stream, chunk)])

    def _chunk(self, stream: _Stream, out: RequestOutput) -> Chunk:
        """The step's new text (decoded incrementally by the engine: ``stream_text``) and logprobs."""
        logprobs = None
        if out.logprobs is not None and len(out.logprobs) > stream.num_logprobs:
            ids, k = out.token_ids, stream.params.logprobs
            logprobs = [self._entry(ids[i], out.logprobs[i], k) for i in range(stream.num_logprobs, len(out.logprobs))]
            stream.num_logprobs = len(out.logprobs)
        prompt = None
        if out.prompt_logprobs is not None and not stream.prompt_sent and (out.new_token_ids or out.finished):
            ids, k = out.prompt_token_ids, stream.params.prompt_logprobs
            prompt = [self._entry(t, entry, k) for t, entry in zip(ids, out.prompt_logprobs)]
            stream.prompt_sent = True
        return Chunk(out.delta_text, list(out.new_token_ids), out.finished, out.finish_reason, len(out.prompt_token_ids),
                     len(out.token_ids), logprobs, out.metrics if out.finished else None, out.error, prompt)

    def _entry(self, token: int, entry: dict[int, float] | None, k: int) -> dict:
        """One token's log-probability entry: its text, id, log-probability and the ``k`` most
        likely tokens there (logprob and top are None where nothing precedes the token)."""
        if entry is None:
            return {"token": self._piece(token), "token_id": token, "logprob": None, "top": None}
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        return {"token": self._piece(token), "token_id": token, "logprob": entry[token],
                "top": [(self._piece(t), lp) for t, lp in top]}

    def _piece(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _snapshot(self) -> dict:
        engine = self.engine
        stats = engine.metrics()
        stats.update(running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting), time=time.time())
        return stats


def _put_all(items: list[tuple[_Stream, Chunk]]) -> None:
    """On the stream's event loop: queue each chunk; a last one releases its request at once
    (``on_finish``), whether or not anyone reads the queue."""
    for stream, chunk in items:
        stream.queue.put_nowait((stream.request_id, chunk))
        if chunk.finished and stream.on_finish is not None:
            try:
                stream.on_finish(stream.request_id, chunk)
            except Exception:  # noqa: BLE001 - one callback must not lose the others' chunks
                log.exception("releasing request %s failed", stream.request_id)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass
