"""The `device` pass: mark the nodes whose kernel has a variant for the device the step
runs on.

Some kernels choose between algorithms whose speed depends on the device: on a CPU a
convolution is a flat shift (one GEMM per kernel offset, no im2col buffer) or Winograd, on
a GPU, where each launch costs more than the bytes it moves, the columns and one batched
GEMM. The choice changes the kernel's scratch, which the memory plan reserves from the
op's workspace rule, so it cannot be made inside the kernel alone: this pass records it on
the node (`target = "gpu"`, on ops declaring extra={"gpu_variant": True}) before the step
is planned, and the kernel and its workspace rule both read it. A marked graph still runs
on the CPU (the same xp code), only not on the CPU's fastest paths.
"""
from __future__ import annotations

from netdsl.errors import NetdslError
from netdsl.ir import registry
from netdsl.ir.graph import Graph
from netdsl.passes.registry import register_pass

DEVICES = ("cpu", "gpu")


@register_pass("device")
def for_device(g: Graph, kind: str = "cpu") -> Graph:
    """Mark the nodes with a variant for device `kind` (cpu: none; gpu: the convolutions)."""
    if kind not in DEVICES:
        raise NetdslError(f"unknown device kind `{kind}`; choose one of {', '.join(DEVICES)}")
    if kind == "cpu":
        return g
    g = g.copy()
    for n in g.nodes:
        if registry.OPS[n.op].extra.get("gpu_variant"):
            n.attrs["target"] = kind
    return g
