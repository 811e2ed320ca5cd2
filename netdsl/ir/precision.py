"""What mixed precision asks of a node's kernel, for the executor that runs it and the
storage plan that counts its bytes (one rule for both, so they agree).

A bf16 or f16 value is stored in its 2 bytes; kernels compute in f32. Where an op's kernel
reads and writes the 2-byte types itself on a device (`OpDef.reads_reduced`: the ops that
move values, the cast, the GPU's cuBLAS and cuDNN products), it gets them as they are;
everywhere else the executor converts the node's 2-byte inputs to f32 before its kernel
and the kernel's result to the node's type after it. Those f32 copies live while the
kernel runs: the plan counts them as the node's workspace.
"""
from __future__ import annotations

from netdsl.ir import registry
from netdsl.ir.types import REDUCED_DTYPES

DEVICES = ("cpu", "gpu")


def device_of_backend(name: str) -> str:
    """The device kind whose kernels a backend runs ("numpy": the CPU's)."""
    return "gpu" if name == "cupy" else "cpu"


def converted(g, n, device: str) -> tuple[tuple[int, ...], bool]:
    """(the indices of the inputs converted to f32 before `n`'s kernel, whether its result
    is converted to `n`'s 2-byte type after it) on `device`; nothing for a source, an op
    that reads 2-byte values itself there, or a node with none. An input the kernel
    writes in place is never converted (state is f32)."""
    op = registry.OPS[n.op]
    if n.is_source or device in op.reads_reduced:
        return (), False
    written = op.written_inputs(n)
    ins = tuple(k for k, x in enumerate(n.inputs)
                if k not in written and g[x].type.dtype in REDUCED_DTYPES)
    return ins, n.type.dtype in REDUCED_DTYPES


def conversion_bytes(g, n, device: str, compute_size: int = 4) -> int:
    """The f32 copies the executor holds around `n`'s kernel (`converted`), in bytes."""
    ins, out = converted(g, n, device)
    count = sum(g[n.inputs[k]].type.numel() for k in ins) + (n.type.numel() if out else 0)
    return count * compute_size


def conversion_device(g) -> str | None:
    """The device whose kernels' conversions `g`'s plan counts: the one a precision step
    was built for (its meta; else the CPU) where any value is 2-byte (a precision step, or
    f16 a program declares), else None (nothing is converted)."""
    if not any(n.type.dtype in REDUCED_DTYPES for n in g.nodes):
        return None
    return g.meta.get("precision", {}).get("device", "cpu")
