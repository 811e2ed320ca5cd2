"""Worker processes on this machine that share one job out with the calling process, as
MPI ranks share it: `workers(n, target, kwargs)` starts n - 1 processes, each calling
`target(Exchange(r, n, ...), **kwargs)` for r = 1 .. n - 1, and yields rank 0's Exchange,
the caller's: `allgather` (every rank's object, in rank order, on every rank) and
`gather` (on rank 0 only). `netdsl split` and `run --devices` build and predict auto's
candidates so (`choose.Share`).

Workers are fresh interpreters (`python -m netdsl.parallel.fanout`), not forks: a fork
would copy whatever threads the caller runs (BLAS, Numba) in whatever state they are, and
a spawned multiprocessing child re-imports the caller's main script. The job and every
exchange travel as pickles over the worker's stdin and stdout; a worker's own prints go
to its stderr, kept in a file that an error report quotes. A worker that fails sends its
exception (a NetdslError as itself, anything else as its traceback) to the next exchange,
where rank 0 raises it; one that dies (killed, out of memory) is named with its exit
status. The workers are killed when the caller leaves the block, however it leaves it, and
exit by themselves when the caller is killed.
"""
from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from netdsl.errors import NetdslError

_PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclass(frozen=True)
class Exchange:
    """What a rank has of the others: its place, and the two exchanges."""

    rank: int
    size: int
    allgather: Callable[[Any], list]  # every rank's object, in rank order, on every rank
    gather: Callable[[Any], list | None]  # ... on rank 0; None on the others


class WorkerError(NetdslError):
    """A worker process stopped without doing its part (killed, out of memory)."""


def cores() -> int:
    """The cores this process may run on (its affinity, as `taskset` or a container sets
    it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not Linux)
        return max(1, os.cpu_count() or 1)


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    log: IO[bytes]  # its stderr

    def send(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def receive(self) -> Any:
        try:
            kind, value = pickle.load(self.proc.stdout)
        except (EOFError, pickle.UnpicklingError, OSError):
            raise self._died() from None
        if kind == "raised":
            raise value
        if kind == "failed":
            raise RuntimeError(f"worker process {self.rank} failed:\n{value}")
        return value

    def _died(self) -> Exception:
        code = self.proc.wait()
        how = (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        hint = " (perhaps out of memory)" if code == -9 else ""
        tail = self._log_tail()
        return WorkerError(f"worker process {self.rank} (pid {self.proc.pid}) {how}{hint} "
                           "before doing its part; run with --jobs 1 to do it in this "
                           "process" + (f". Its last output: {tail}" if tail else ""))

    def _log_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return " / ".join(lines[-3:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                f.close()
            except OSError:  # (a pipe the worker broke)
                pass


@contextmanager
def workers(n: int, target: str, kwargs: dict) -> Iterator[Exchange]:
    """Start n - 1 workers calling `target` ("module:function") with `kwargs` (pickled)
    and yield rank 0's Exchange (module docstring)."""
    job = pickle.dumps(kwargs, _PROTOCOL)
    env = dict(os.environ)
    # the package this process imported, first on the worker's path; one BLAS thread a
    # worker (the cores are the workers')
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    started: list[_Worker] = []
    try:
        for rank in range(1, n):
            log = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-m", "netdsl.parallel.fanout"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env=env)
            w = _Worker(rank, proc, log)
            started.append(w)
            w.send(pickle.dumps((target, rank, n), _PROTOCOL) + job)

        def gather(obj: Any) -> list:
            return [obj] + [w.receive() for w in started]

        def allgather(obj: Any) -> list:
            parts = gather(obj)
            data = pickle.dumps(parts, _PROTOCOL)
            for w in started:
                w.send(data)
            return parts

        yield Exchange(0, n, allgather, gather)
    finally:
        for w in started:
            w.stop()


def _serve() -> None:
    """A worker's life: read the job, run it, answer each exchange."""
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the worker's prints go to its log, not into the channel

    def put(kind: str, value: Any) -> None:
        pickle.dump((kind, value), out, _PROTOCOL)
        out.flush()

    def allgather(obj: Any) -> list:
        put("part", obj)
        return pickle.load(inp)

    def gather(obj: Any) -> None:
        put("part", obj)

    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    target, rank, size = pickle.load(inp)
    kwargs = pickle.load(inp)
    module, name = target.split(":")
    try:
        getattr(importlib.import_module(module), name)(
            Exchange(rank, size, allgather, gather), **kwargs)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # rank 0 has gone: nobody to tell
    except NetdslError as e:
        put("raised", e)
    except Exception:
        put("failed", traceback.format_exc())


def _exit_with(parent: int) -> None:
    """Exit when the caller has gone (killed: nothing ran its `finally`), rather than
    finish a candidate nobody will read."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


if __name__ == "__main__":
    try:
        _serve()
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
