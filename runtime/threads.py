"""Keeping torch's OpenMP thread pools to one per process while serving.

GNU OpenMP gives every thread that starts parallel work a pool of its own, kept until that thread
ends. Once the pools together hold more threads than there are cores, it stops spin-waiting
between parallel regions and puts its workers to sleep after each one, so every kernel call pays
for waking them: decoding on the server's engine thread ran 1.5x slower after the model had been
loaded on the main thread (whose pool outlives the load). Work done before serving (loading the
model, the first forwards) therefore runs on a thread that ends, taking its pool with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_in_passing_thread(fn: Callable[[], T], name: str = "llmopt-setup") -> T:
    """``fn()`` on a new thread that ends when it returns: its result, or its exception raised here."""
    result: list = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
