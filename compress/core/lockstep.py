"""Run several calls so that a hook inside them can wait for all of them: lockstep batches.

One-pass GPTQ quantizes each Linear of a decoder layer from the inputs of *every* calibration
batch, and then lets the forward go on with the quantized weights, so that the layer's output
(the next layer's input) comes out of the same pass. Each batch's forward runs in its own
greenlet (a coroutine with its own stack, on this thread: torch keeps one thread pool, and
thread-local state such as grad mode and autocast is shared). A forward pre-hook calls
:meth:`Lockstep.meet`: the batch parks there; once every batch has arrived, the action (e.g.
the GPTQ solve) runs once and the batches go on, in order. Each batch keeps its own
intermediates, so memory is that of every batch paused at one point of the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from greenlet import greenlet


def current_context() -> Any:
    """A key for the running batch (its greenlet; each thread's main greenlet otherwise), for
    state that must not leak from one lockstep batch to another."""
    return greenlet.getcurrent()


class Lockstep:
    """Calls run as greenlets that meet at named points (see the module docstring).

    Between two meeting points the calls run one after another in their order, so what hooks
    accumulate (e.g. Hessian sums) adds up in the same order as a plain loop over the batches.
    """

    def __init__(self) -> None:
        self._scheduler: greenlet | None = None

    def meet(self, key: str, action: Callable[[], None]) -> None:
        """Park the running call at ``key`` until every call has reached it; ``action`` then runs
        once (from the scheduler, with no call running) before they go on."""
        if self._scheduler is None:
            raise RuntimeError("Lockstep.meet called outside Lockstep.run")
        self._scheduler.switch((key, action))

    def run(self, calls: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` in lockstep; their results in order. An exception raised by a call or
        an action is raised here."""
        self._scheduler = greenlet.getcurrent()
        results: list[Any] = [None] * len(calls)
        lets = [greenlet(call) for call in calls]
        running = list(range(len(calls)))
        try:
            while running:
                parked: dict[int, tuple[str, Callable[[], None]]] = {}
                for i in running:
                    value = lets[i].switch()
                    if lets[i].dead:
                        results[i] = value
                    else:
                        parked[i] = value
                if not parked:
                    break
                keys = {key for key, _ in parked.values()}
                if len(parked) != len(running) or len(keys) != 1:
                    raise RuntimeError(f"lockstep calls took different paths (met at {sorted(keys)}, "
                                       f"{len(running) - len(parked)} ended)")
                parked[max(parked)][1]()
                running = sorted(parked)
        finally:
            # on an error, unwind the parked calls now, inside the caller's context managers:
            # unwound later by the garbage collector, their own `with` blocks (autocast, grad
            # mode: thread state) would exit at some arbitrary point of the program
            for let in reversed(lets):
                if not let.dead:
                    let.throw()
            self._scheduler = None
        return results
