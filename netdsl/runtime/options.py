"""What `netdsl run` is asked to do: its options (`RunOptions`, declared in
netdsl.options), the training configuration they override (`resolve_config`), the checks
made before any work (`check_options`, `preflight`) and the backend and GPU they pick
(`backend_for`)."""
from __future__ import annotations

import os
from pathlib import Path

from netdsl.backends import get_backend
from netdsl.errors import NetdslError, NoSuchGpu
from netdsl.options import RunOptions, conflicts
from netdsl.runtime import checkpoint
from netdsl.step.request import resolve_config

__all__ = ["RunOptions", "backend_for", "check_options", "gpu_of", "preflight",
           "resolve_config"]


def check_options(opts: RunOptions) -> list[str]:
    """The options checked together (`netdsl.options.conflicts`): an error where they
    cannot mean what was asked, else a warning for each that does nothing."""
    return conflicts(opts)


def preflight(opts: RunOptions) -> None:
    """Check the paths a run writes before it starts: a checkpoint folder that cannot be
    made or written, or a log that cannot be opened, would otherwise fail after the last
    step."""
    if opts.checkpoint:
        d = Path(opts.checkpoint)
        if d.exists() and not d.is_dir():
            raise NetdslError(f"--checkpoint {d} is a file, not a directory; give a "
                              "directory to hold checkpoint.npz")
        try:
            d.mkdir(parents=True, exist_ok=True)
            # one probe per process: the ranks of an MPI run check the same folder at once
            probe = d / f".netdsl-write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise NetdslError(f"--checkpoint {d} is not writable: "
                              f"{e.strerror or e}") from None
        if not (opts.resume or opts.overwrite) and checkpoint.path_in(d).exists():
            # a run that forgot --resume would replace days of training at its first save
            try:
                held = checkpoint.load(d)[1]
                what = f" (network `{held.get('network')}`, step {held.get('step')})"
            except NetdslError:
                what = ""
            raise NetdslError(f"--checkpoint {d} already holds a checkpoint{what}; give "
                              "--resume to go on from it, --overwrite to start over and "
                              "replace it, or another directory")
    if opts.log:
        p = Path(opts.log)
        if p.is_dir():
            raise NetdslError(f"--log {p} is a directory; give a file name")
        try:
            with open(p, "a"):  # creates it if needed, truncates nothing
                pass
        except OSError as e:
            raise NetdslError(f"--log {p} cannot be written: {e.strerror or e}") from None


def gpu_of(opts: RunOptions) -> int:
    """The GPU this process uses: --device, else over MPI with CuPy the rank's place among
    the ranks on its machine (two ranks on a two-GPU machine both took GPU 0), else 0."""
    if opts.device is not None:
        return opts.device
    if not (opts.distributed and opts.backend == "cupy"):
        return 0
    from netdsl.runtime.mpi import world_on_this_machine
    return world_on_this_machine()[0]


def backend_for(opts: RunOptions):
    """The backend `opts` asks for, on its GPU (`gpu_of`); a missing GPU in words."""
    try:
        return get_backend(opts.backend, gpu_of(opts))
    except NoSuchGpu as e:
        if opts.device is not None or not opts.distributed:
            raise
        raise NoSuchGpu(f"{e.message} Over MPI each rank takes the GPU numbered as its "
                          "place among the ranks on its machine: start at most as many ranks "
                          "on a machine as it has GPUs, or give --device N to put them all "
                          "on GPU N.") from None
