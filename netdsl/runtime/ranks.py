"""Joining the ranks of `mpiexec`: this process's place among them and its communicator,
NCCL's on GPUs where every rank has it (`nccl`), else host MPI's (`mpi`). A module of its
own because it reads both, and NCCL's communicator extends MPI's."""
from __future__ import annotations

from netdsl.errors import NetdslError
from netdsl.runtime.mpi import MPIComm, allgather, world
from netdsl.runtime.nccl import communicator
from netdsl.step.request import World


def join(devices: int, backend) -> tuple[World, MPIComm, str | None]:
    """This rank's place among the ranks of `mpiexec`, one device each, its communicator
    (NCCL's on GPUs where every rank has it: `runtime.nccl`) and what the run says about
    it; refused where there is one rank, or `devices` is not their count."""
    rank, size = world()
    if size == 1:  # (a split of one device has no parts to spread)
        raise NetdslError("--distributed runs one process per device under `mpiexec -n N` "
                          "with N of 2 or more, and this is one process; run without "
                          "--distributed, or under mpiexec")
    if devices not in (1, size):
        raise NetdslError(f"--devices {devices} but mpiexec started {size} ranks; with "
                          "--distributed there is one device per rank")
    return World(rank, size, allgather), *communicator(backend)
