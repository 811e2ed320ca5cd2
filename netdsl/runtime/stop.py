"""Stopping a run cleanly: the first Ctrl-C (SIGINT) or SIGTERM (a cluster's scheduler
pre-empting the job) asks the trainer to stop after the step it is running, save the
checkpoint and report; a second one stops at once, as before (the last checkpoint kept).

A step stopped half way would leave some parameters updated and others not, which is why
the first signal only raises a flag the trainer reads between steps. The handlers stay
through the final checkpoint save, which a first signal lets finish too. They are set only
on the main thread (Python runs signal handlers there) and put back after that save.
"""
from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A context manager; `requested` is the name of the first signal this process got
    ("SIGINT"), or None. The trainer decides on `agreed`: over MPI the first signal any
    rank had got by the agreement after a step, else `requested` then. Only the handler
    writes `requested`: the agreement, which wrote its result there, lost a signal that
    arrived while it waited for the other ranks (where a rank waits most), and the ranks
    trained on. A signal is "the second" only where this process got one before: mpiexec
    passes Ctrl-C to the ranks one after another, and a rank can get it after the ranks
    agreed to stop on another's, while it saves (stopped at once there, it left the others
    waiting)."""

    def __init__(self):
        self.requested: str | None = None
        self.agreed: str | None = None  # the trainer's decision after a step (every rank's)
        self.received = 0  # signals this process got
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        self.received += 1
        if self.received > 1:  # the second: stop now
            self._restore()
            raise KeyboardInterrupt
        if self.requested is None:
            self.requested = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def _restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def __exit__(self, *exc) -> bool:
        self._restore()
        return False
