"""What mixed precision asks of a node's kernel, for the executor that runs it and the
storage plan that counts its bytes (one rule for both, so they agree).

A bf16 or f16 value is stored in its 2 bytes; kernels compute in f32. Where an op's kernels
of a kind (netdsl.ir.opdef.ANY_DEVICE: "cpu", "numba", "gpu") read and write the 2-byte
types themselves (`OpDef.reads_reduced`: the ops that move values, the cast, the GPU's
cuBLAS and cuDNN products, the fused loops that read bf16 bits), the node gets them as
they are; everywhere else the executor converts its 2-byte inputs to f32 before its
kernel and the kernel's result to the node's type after it. Those f32 copies live while
the kernel runs: the plan counts them as the node's workspace.
"""
from __future__ import annotations

import importlib.util

from netdsl.config import FUSED_ENV, env_switch
from netdsl.ir import registry
from netdsl.ir.types import REDUCED_DTYPES


def cpu_kernels() -> str:
    """The kind of kernels a NumPy run here takes: "numba" where the fused loops load
    (Numba installed, NETDSL_FUSED_KERNELS not 0), else "cpu"."""
    fused = env_switch(FUSED_ENV, True) and importlib.util.find_spec("numba") is not None
    return "numba" if fused else "cpu"


def kernels_of(device: str) -> str:
    """The kind of kernels a step built for `device` ("cpu" or "gpu") runs."""
    return "gpu" if device == "gpu" else cpu_kernels()


def kernels_of_backend(backend) -> str:
    """The kind of kernels `backend` runs (CuPy's "gpu"; NumPy's "numba" with its fused
    loops, else "cpu")."""
    if getattr(backend, "name", "numpy") == "cupy":
        return "gpu"
    return "numba" if getattr(backend, "fused", None) is not None else "cpu"


def converted(g, n, device: str) -> tuple[tuple[int, ...], bool]:
    """(the indices of the inputs converted to f32 before `n`'s kernel, whether its result
    is converted to `n`'s 2-byte type after it) with kernels of kind `device`; nothing for
    a source, an op that reads 2-byte values itself there, or a node with none. An input
    the kernel writes in place is never converted (state is f32)."""
    op = registry.OPS[n.op]
    if n.is_source or _reads(op, g, n, device):
        return (), False
    written = op.written_inputs(n)
    ins = tuple(k for k, x in enumerate(n.inputs)
                if k not in written and g[x].type.dtype in REDUCED_DTYPES)
    return ins, n.type.dtype in REDUCED_DTYPES


def _reads(op, g, n, device: str) -> bool:
    """Whether `n`'s kernels of kind `device` read and write its 2-byte values themselves:
    as the op declares, except that the fused loops ("numba") read bf16 bits only (Numba
    has no float16), unless the op reads them anywhere (it only moves them)."""
    if device not in op.reads_reduced:
        return False
    if device != "numba" or "cpu" in op.reads_reduced:
        return True
    return all(t.dtype != "f16" for t in [n.type, *(g[x].type for x in n.inputs)])


def conversion_bytes(g, n, device: str, compute_size: int = 4) -> int:
    """The f32 copies the executor holds around `n`'s kernel (`converted`), in bytes."""
    ins, out = converted(g, n, device)
    count = sum(g[n.inputs[k]].type.numel() for k in ins) + (n.type.numel() if out else 0)
    return count * compute_size


def conversion_device(g) -> str | None:
    """The kind of kernels whose conversions `g`'s plan counts: the one a precision step
    was built for (its meta; else this machine's CPU kernels) where any value is 2-byte
    (a precision step, or f16 a program declares), else None (nothing is converted)."""
    if not any(n.type.dtype in REDUCED_DTYPES for n in g.nodes):
        return None
    return g.meta.get("precision", {}).get("device") or cpu_kernels()
