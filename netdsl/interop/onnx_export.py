"""Export a netdsl network's forward graph to ONNX (opset 17), in evaluation mode.

The operators are written by the table in `onnx_export_ops`; this module builds the graph
around them: inputs (the batch dimension `N` symbolic unless a batch is bound), the weights
as initializers, the declared outputs, shape inference and `onnx.checker` with
`full_check`. ONNX node names are netdsl's node names, which carry the block-instance path
(`stage[2].bottleneck[1].conv2d`), and each block call is a call of an ONNX local
function (`onnx_functions`), so the structure shows in Netron; helper nodes an operator
needs are named under it (`...gelu/Erf`). Models whose weights pass the 2 GiB
protobuf limit keep them in a file beside the model (`out.onnx.data`), written one tensor
at a time so the export never holds them all.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from netdsl.errors import InteropError
from netdsl.interop import require_onnx
from netdsl.interop.onnx_export_ops import EXPORTERS
from netdsl.interop.onnx_functions import FUNCTION_DOMAIN, block_functions
from netdsl.interop.onnx_half import half_weight, to_half
from netdsl.interop.weights import Weights
from netdsl.ir.graph import STATE_OPS, Graph, Node
from netdsl.ir.types import BATCH, TensorType

OPSET = 17
IR_VERSION = 8  # the IR of opset 17 (ONNX 1.12): loadable by older runtimes too
# weights above this go to an external data file (protobuf refuses messages over 2 GiB)
EXTERNAL_BYTES = 1 << 30

_ELEM = {"f16": "FLOAT", "f32": "FLOAT", "f64": "FLOAT", "i32": "INT32", "i64": "INT64",
         "bool": "BOOL"}  # floats run at f32, as the executor runs them


@dataclass
class ExportResult:
    path: Path
    data_path: Path | None  # the external weights file, if any
    network: str
    batch: int | str
    nodes: int  # ONNX nodes, function bodies included
    functions: int  # ONNX local functions (one per distinct block body)
    weights: int  # elements in the weights (parameters and buffers)
    weight_bytes: int
    opset: int = OPSET

    def to_json(self) -> dict:
        return {"onnx": str(self.path), "data": str(self.data_path) if self.data_path else None,
                "network": self.network, "batch": self.batch, "nodes": self.nodes,
                "functions": self.functions, "weights": self.weights,
                "weight_bytes": self.weight_bytes, "opset": self.opset}


def needed_nodes(g: Graph) -> list[Node]:
    """The nodes the declared outputs depend on, in graph order (losses and labels drop)."""
    outs = g.outputs.get("output", [])
    if not outs:
        raise InteropError(f"network `{g.name}` declares no `output`; ONNX export writes the "
                           "forward network's outputs")
    need, stack = set(), list(outs)
    while stack:
        name = stack.pop()
        if name not in need:
            need.add(name)
            stack.extend(g[name].inputs)
    return [n for n in g.nodes if n.name in need]


class Emitter:
    """What an exporter writes ONNX nodes and constants through (see onnx_export_ops)."""

    def __init__(self, onnx, graph: Graph):
        self.onnx = onnx
        self.graph = graph
        self.nodes: list = []
        self.by_node: dict[str, list] = {}  # netdsl node -> the ONNX nodes written for it
        self.node: Node | None = None
        self._count = 0
        self._done = False

    def type(self, name: str) -> TensorType:
        return self.graph[name].type

    def _fresh(self, tag: str) -> str:
        self._count += 1
        return f"{self.node.name}/{tag}" + (f"_{self._count}" if self._count > 1 else "")

    def _node(self, op_type, inputs, out, name, attrs):
        n = self.node
        doc = f"netdsl {n.op}" + (f" at {n.loc}" if n.loc else "")
        made = self.onnx.helper.make_node(op_type, list(inputs), [out], name=name,
                                          doc_string=doc, **attrs)
        self.nodes.append(made)
        self.by_node.setdefault(n.name, []).append(made)

    def emit(self, op_type: str, inputs, **attrs) -> str:
        """A helper node; returns its output's name."""
        out = self._fresh(op_type)
        self._node(op_type, inputs, out, out, attrs)
        return out

    def result(self, op_type: str, inputs, **attrs) -> None:
        """The node whose output is the netdsl node's value (named like it)."""
        self._node(op_type, inputs, self.node.name, self.node.name, attrs)
        self._done = True

    def const(self, array: np.ndarray, tag: str) -> str:
        """A constant, as a Constant node (so a block's function body holds its own)."""
        name = self._fresh(tag)
        value = self.onnx.numpy_helper.from_array(np.asarray(array), name)
        self._node("Constant", [], name, name, {"value": value})
        return name

    def scalar(self, value: float, tag: str) -> str:
        return self.const(np.array(value, dtype=np.float32), tag)

    def ints(self, values, tag: str) -> str:
        return self.const(np.array(values, dtype=np.int64), tag)

    def shape_spec(self, n: Node) -> list[int]:
        """A reshape target in ONNX terms: a leading batch `N` copies the input's (0), one
        other symbolic dimension becomes -1."""
        x = self.type(n.inputs[0])
        spec, symbolic = [], []
        for i, d in enumerate(n.attrs["shape"]):
            if isinstance(d, int):
                spec.append(d)
            elif i == 0 and d == BATCH and x.shape and x.shape[0] == BATCH:
                spec.append(0)
            else:
                symbolic.append(i)
                spec.append(-1)
        if len(symbolic) > 1 or (symbolic and spec.count(-1) > 1):
            raise InteropError(f"reshape %{n.name} to {n.attrs['shape']} has more than one "
                               "dimension ONNX cannot know statically; export with --batch B",
                               loc=n.loc, stack=n.stack)
        return spec

    def run(self, n: Node, xs: list[str]) -> None:
        self.node, self._count, self._done = n, 0, False
        EXPORTERS[n.op](self, n, xs)
        if not self._done:  # pragma: no cover - an exporter that forgot its result
            raise AssertionError(f"exporter for {n.op} produced no result")


def _value_info(onnx, name: str, t: TensorType):
    # the batch is the named dimension N; a derived one (N*64 after a reshape) is unnamed
    dims = [d if isinstance(d, int) else (d if d == BATCH else None) for d in t.shape]
    elem = getattr(onnx.TensorProto, _ELEM[t.dtype])  # (--half: made float16 after)
    return onnx.helper.make_tensor_value_info(name, elem, dims)


def export_onnx(graph: Graph, weights: Weights, path: str | Path, *,
                batch: int | None = None, external: bool | None = None, flat: bool = False,
                progress: Callable[[int, int], None] | None = None,
                half: bool = False) -> ExportResult:
    """Write `graph`'s forward network (its `output`s) to `path` as ONNX and check it.

    graph: a forward graph (`Network.lower()`); batch: bind `N` to it (default: keep `N`
    symbolic); weights: the value of each parameter and buffer node; external: keep the
    weights in `path.data` (default: only when they pass 1 GiB); flat: no local functions
    for the blocks (the node names still carry them); progress(done, total) is
    called as the weights are written; half: the weights and every float the model
    computes in float16 (`onnx_half`; else float32, whatever precision trained them).
    Raises InteropError, listing every operator that has no ONNX form, before anything
    is written.
    """
    onnx = require_onnx()
    g = graph.bind(batch) if batch is not None else graph
    nodes = needed_nodes(g)
    missing: dict[str, list[str]] = {}
    for n in nodes:
        if not n.is_source and n.op not in EXPORTERS:
            missing.setdefault(n.op, []).append(n.name)
    if missing:
        parts = [f"`{op}` ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})"
                 for op, names in missing.items()]
        raise InteropError(f"network `{g.name}` uses operators with no ONNX export yet: "
                           + "; ".join(parts))

    em = Emitter(onnx, g)
    inputs, state = [], []
    for n in nodes:
        if n.op == "input":
            inputs.append(_value_info(onnx, n.name, n.type))
        elif n.op in STATE_OPS:
            state.append(n)
        else:
            em.run(n, list(n.inputs))
    outputs = [_value_info(onnx, name, g[name].type) for name in g.outputs["output"]]

    path = Path(path)
    total = sum(n.type.nbytes() // (2 if half and n.type.is_float else 1) for n in state)
    if external is None:
        external = total > EXTERNAL_BYTES
    data_path = path.with_name(path.name + ".data") if external else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        inits = _initializers(onnx, state, weights, data_path, progress, half)
        return _finish(onnx, g, em, nodes, inputs, outputs, inits, path, data_path, flat,
                       state, total, half)
    except OSError as e:
        raise InteropError(f"cannot write {e.filename or path}: {e.strerror or e}") from None


def _finish(onnx, g, em, nodes, inputs, outputs, inits, path, data_path, flat, state, total,
            half):
    """Assemble the model (`half`: in float16), infer its shapes, check it, save it."""
    body, functions = em.nodes, []
    if not flat:
        body, functions = block_functions(onnx, g, nodes, em.by_node, OPSET)
    gp = onnx.helper.make_graph(body, g.name, inputs, outputs, initializer=inits,
                                doc_string=f"netdsl network `{g.name}`, evaluation mode")
    opsets = [onnx.helper.make_opsetid("", OPSET)]
    if functions:
        opsets.append(onnx.helper.make_opsetid(FUNCTION_DOMAIN, 1))
    model = onnx.helper.make_model(gp, opset_imports=opsets, functions=functions,
                                   producer_name="netdsl", producer_version=_version())
    model.ir_version = IR_VERSION
    onnx.helper.set_model_props(model, {"netdsl.network": g.name})
    if half:
        to_half(onnx, model)
    try:
        if data_path is not None:
            onnx.save_model(model, path)
            onnx.shape_inference.infer_shapes_path(str(path), str(path), check_type=True,
                                                   strict_mode=True, data_prop=True)
            onnx.checker.check_model(str(path), full_check=True)
        else:
            model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                                      data_prop=True)
            onnx.checker.check_model(model, full_check=True)
            onnx.save_model(model, path)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        # a model netdsl made that ONNX rejects is netdsl's bug; say what ONNX said
        raise InteropError(f"the exported model of `{g.name}` fails ONNX's checks (a bug in "
                           f"netdsl's exporter): {e}") from None
    return ExportResult(path, data_path, g.name, g.batch, len(em.nodes), len(functions),
                        sum(n.type.numel() for n in state), total)


def _initializers(onnx, state: list[Node], weights: Weights, data_path: Path | None,
                  progress, half: bool = False) -> list:
    out = []
    fh = open(data_path, "wb") if data_path is not None else None  # noqa: SIM115
    try:
        for k, n in enumerate(state):
            arr = np.ascontiguousarray(weights(n))
            want = tuple(n.type.shape)
            if arr.shape != want:
                raise InteropError(f"weight `{n.name}` has shape {arr.shape}, the network "
                                   f"expects {want}")
            if half:
                arr = half_weight(n.name, arr)
            t = onnx.numpy_helper.from_array(arr, n.name)
            if fh is not None and arr.size > 256:  # small ones stay inline
                offset = fh.tell()
                fh.write(t.raw_data)
                onnx.external_data_helper.set_external_data(t, data_path.name, offset,
                                                            len(t.raw_data))
                t.ClearField("raw_data")
            out.append(t)
            if progress is not None:
                progress(k + 1, len(state))
    finally:
        if fh is not None:
            fh.close()
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("netdsl")
    except PackageNotFoundError:
        return "unknown"
