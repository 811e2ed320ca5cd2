"""The weights an exported network carries: from a checkpoint, or the seeded initialisation
`netdsl run` would start from (the same values for the same seed and node name)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from netdsl.ir.graph import STATE_OPS, Graph, Node
from netdsl.ir.types import NUMPY_DTYPE
from netdsl.runtime import checkpoint
from netdsl.runtime.executor import init_value

Weights = Callable[[Node], np.ndarray]


def _dtype(n: Node) -> str:
    return "float32" if n.type.is_float else NUMPY_DTYPE[n.type.dtype]


def seeded(seed: int = 0) -> Weights:
    """The executor's initial value of each parameter and buffer (float32)."""
    return lambda n: init_value(n, _dtype(n), seed)


def from_checkpoint(path: str | Path, graph: Graph) -> Weights:
    """The values in a checkpoint (a training checkpoint, whose optimizer state is ignored,
    or the weights `netdsl import` writes), checked against the graph's parameters and
    buffers: every one present, with its shape; the network's name must match."""
    arrays, header = checkpoint.load(path)
    where = checkpoint.file_of(path)
    # by the header's shapes: each array is read from disk when used
    checkpoint.check_holds(str(where), header, graph.name,
                           {n.name: n.type.bind(1).shape for n in graph.nodes
                            if n.op in STATE_OPS})
    return lambda n: np.ascontiguousarray(arrays[n.name], dtype=_dtype(n))
