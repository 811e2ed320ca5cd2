"""A run's state in and out of checkpoints, in the single-device layout whatever the
split: over MPI rank 0 gathers every rank's parts while it writes, and each rank takes its
own part of a checkpoint it reads."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from netdsl.errors import CheckpointError
from netdsl.ir.graph import Graph
from netdsl.runtime import checkpoint
from netdsl.runtime.executor import Executor


class RunState:
    def __init__(self, executor: Executor, forward: Graph, folder: str | None,
                 distributed: bool):
        self.executor, self.forward = executor, forward
        self.folder, self.distributed = folder, distributed

    def spec(self) -> dict[str, tuple]:
        spec = self.executor.state_spec()
        if self.distributed:  # every rank's part: the single-device layout
            from netdsl.runtime.mpi import merge_all
            spec = merge_all(spec)
        return spec

    def items(self):
        """The whole state in the single-device layout, (key, host array) one entry at a
        time (over MPI: on rank 0, which must take every item, while the other ranks send
        their parts; None elsewhere). The arrays may be the state itself: read each before
        the next step."""
        ex = self.executor
        if not self.distributed:
            return ex.state_items(copy=False)
        return ex.comm.gather_state(ex.state_parts(), lambda x: ex.host_state(x, copy=False))

    def copy(self) -> dict | None:
        """A copy of the whole state (over MPI: on rank 0, else None; every rank calls)."""
        items = self.items()
        return None if items is None else {k: np.array(v) for k, v in items}

    def save(self, header: dict) -> Path | None:
        """Write the checkpoint (over MPI rank 0 writes it as the parts arrive, and every
        rank learns whether that worked: a failed save stops every rank with its reason;
        the checkpoint there before is kept)."""
        items = self.items()
        if not self.distributed:
            return checkpoint.save(self.folder, items, header)
        path, failed = None, ""
        if items is not None:
            try:
                path = checkpoint.save(self.folder, items, header)
            except CheckpointError as e:
                failed = e.message
            finally:
                for _ in items:  # the other ranks' parts, so that their sends complete
                    pass
        from netdsl.runtime.mpi import bcast
        failed = bcast(failed)
        if failed:
            raise CheckpointError(failed)
        return path

    def restore(self) -> dict | None:
        """Load the checkpoint into the executor; its header, or None for initial weights
        (`netdsl import`: parameters and buffers only, training starts at step 0 with fresh
        optimizer state, at this run's dtype)."""
        arrays, header = checkpoint.load(self.folder)
        where = str(checkpoint.path_in(self.folder))
        if header.get("kind") == "weights":
            spec = {k: (s, header["arrays"].get(k, [None, d])[1])
                    for k, (s, d) in self.spec().items() if k in self.forward}
            checkpoint.check_compatible(where, header, self.forward.name, spec)
            self.executor.load_state_dict(arrays, strict=False)
            return None
        checkpoint.check_compatible(where, header, self.forward.name, self.spec())
        # over MPI each rank takes its own part of the (complete, just checked) file
        self.executor.load_state_dict(arrays, strict=not self.distributed)
        return header
