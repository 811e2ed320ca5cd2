"""The memory a run can take, and saying so when a step does not fit it: what is free
where the run allocates (`available_bytes`), the --mem budget a step is planned into
within it (`budget_within`), and the out-of-memory error in words (`out_of_memory`).
Read before a run's first step; tests stand in for `available_bytes` here.
"""
from __future__ import annotations

from netdsl.backends import host_memory
from netdsl.errors import NetdslError
from netdsl.sizes import format_bytes

# (one device's runs; the message's "activations shrink with it" goes before it)
ACCUMULATE = (", more --microbatches (the batch in parts, one after the other, "
              "their gradients accumulated)")


def available_bytes(backend) -> int | None:
    """Free memory where the run allocates: the device's for CuPy (with what CuPy's pool
    holds free, which the step reuses), else the host's (less where the process's cgroup,
    a container's limit, leaves less)."""
    try:
        if backend.name == "cupy":
            return int(backend.xp.cuda.Device().mem_info[0]) + int(
                backend.xp.get_default_memory_pool().free_bytes())
        return host_memory.available_bytes()
    except Exception:  # noqa: BLE001 - an estimate only; the error is said without it
        return None


def budget_within(free: int, ranks: int = 1) -> str:
    """The --mem budget for a step planned into `free` bytes shared by `ranks` processes:
    nine tenths of a rank's share, rounded down to two figures (21GB, 4.8GB, 730MB); the
    rest is left for what a run holds besides its plan (the interpreter and libraries)."""
    share = max(free * 0.9 / ranks, 1)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)):
        if share >= scale:
            v = share / scale
            return f"{int(v)}{unit}" if v >= 10 else f"{int(v * 10) / 10:g}{unit}"
    raise AssertionError("unreachable: share >= 1")


def where(backend) -> str:
    return where_kind("gpu" if backend.name == "cupy" else "cpu")


def where_kind(device_kind: str) -> str:
    return "the GPU" if device_kind == "gpu" else "this machine"


def out_of_memory(needed: int, backend, batch: int, when: str,
                  free: int | None = None, budget: int | None = None,
                  ranks: int = 1, part: str = "rank") -> NetdslError:
    """A MemoryError (NumPy) or CuPy's OutOfMemoryError, or a step planned past the free
    memory, in words: what the step needs (static liveness analysis), what is free, and
    what to change (`budget`: the --mem it was planned into, if any; `ranks`: the parts
    sharing that memory, whose needs `needed` sums: MPI ranks, or with `part="device"`
    the logical devices of a split run in this one process)."""
    free = available_bytes(backend) if free is None else free
    at = where(backend)
    have = (f"about {format_bytes(free)} is free on {at}" if free is not None
            else f"{at} has less free")
    smaller = max(batch // 2, 1)
    if budget is not None:
        share = f"each {part}'s share of " if ranks > 1 else ""
        fit = f"a --mem budget below {share}what is free (it was {format_bytes(budget)}), "
    elif free is not None:
        each = f" for each {part}" if ranks > 1 else ""
        fit = (f"--mem {budget_within(free, ranks)} to plan the step into it{each} "
               "(activations recomputed or offloaded), ")
    else:
        fit = "--mem to plan the step into less memory, "
    sharing = (f"{ranks} ranks sharing {at}" if part == "rank" else
               f"{ranks} devices of the split, all in this process,")
    who = (f"the {sharing} need about {format_bytes(needed)} together for a training step"
           if ranks > 1 else f"a training step needs about {format_bytes(needed)}")
    fewer = ((", fewer ranks on one machine" if part == "rank" else ", another --split")
             if ranks > 1 else ACCUMULATE if batch > 1 else "")
    return NetdslError(
        f"out of memory {when}: {who} (parameters, optimizer state and the activations "
        f"kept for backward, at batch {batch}), but {have}; use {fit}a smaller batch (e.g. "
        f"--batch {smaller}: activations shrink with it){fewer}, or a smaller network")
