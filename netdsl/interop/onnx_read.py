"""Read an ONNX model into a flat program of netdsl operator calls (`Program`), through the
table in `onnx_import_ops`. Every node that has no netdsl form is collected, and all of
them are reported in one InteropError."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from netdsl.errors import InteropError
from netdsl.interop.onnx_import_ops import IMPORTERS, Unsupported
from netdsl.interop.onnx_patterns import fuse_gelu
from netdsl.ir.types import BATCH, TensorType

_DTYPE = {"FLOAT": "f32", "DOUBLE": "f32", "FLOAT16": "f32", "INT64": "i64", "INT32": "i32",
          "BOOL": "bool"}


@dataclass
class Call:
    """One netdsl operator call: `out = op(args..., **attrs)` owning `params`."""

    op: str
    args: list[str]
    attrs: dict
    params: dict[str, np.ndarray]
    out: str
    source: str  # the ONNX node it came from


@dataclass
class Program:
    name: str
    inputs: list[tuple[str, TensorType]]
    calls: list[Call]
    outputs: list[str]
    output_types: list[tuple] = field(default_factory=list)  # ONNX's shapes, batch first
    info: dict = field(default_factory=dict)


def _node_label(node, k: int) -> str:
    return node.name or f"#{k} {node.op_type} -> {node.output[0] if node.output else '?'}"


class Reader:
    """What importers see: constants, inferred shapes, and the calls made so far."""

    def __init__(self, onnx, model):
        self.onnx = onnx
        g = model.graph
        self.consts: dict[str, np.ndarray] = {
            t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
        try:
            inferred = onnx.shape_inference.infer_shapes(model).graph
        except Exception:  # shapes are a help (Reshape's 0, Slice ends); go on without
            inferred = g
        self.shapes: dict[str, tuple] = {}
        for vi in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
            t = vi.type.tensor_type
            if t.HasField("shape"):
                self.shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value")
                                             else (d.dim_param or "?") for d in t.shape.dim)
        self.opsets = list(model.opset_import)
        self.uses: Counter = Counter()
        self.aliases: dict[str, str] = {}
        self.calls: list[Call] = []
        self.producer: dict[str, Call] = {}
        self._source = ""

    # -- for importers ---------------------------------------------------------------------
    def name(self, v: str) -> str:
        while v in self.aliases:
            v = self.aliases[v]
        return v

    def const(self, v: str) -> np.ndarray | None:
        return self.consts.get(self.name(v))

    def shape(self, v: str) -> tuple:
        s = self.shapes.get(self.name(v)) or self.shapes.get(v)
        if s is None:
            raise Unsupported(f"a value whose shape ONNX shape inference cannot give ({v})")
        return s

    def alias(self, out: str, src: str) -> None:
        src = self.name(src)
        if src in self.consts:
            self.consts[out] = self.consts[src]
        else:
            self.aliases[out] = src

    def call(self, op: str, args: list[str], attrs: dict, params: dict, out: str) -> None:
        params = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()}
        c = Call(op, [self.name(a) for a in args], attrs, params, out, self._source)
        self.calls.append(c)
        self.producer[out] = c

    def parameter(self, value: np.ndarray, out: str) -> str:
        """A trainable tensor holding a constant operand (netdsl's `parameter(shape)`)."""
        name = out + "/parameter"
        self.call("parameter", [], {"shape": tuple(int(d) for d in value.shape)},
                  {"value": value}, name)
        return name

    def add_bias(self, x: str, bias: np.ndarray, out: str) -> bool:
        """Fold `x + bias` into the bias-free linear that made x, if it is x's only use."""
        c = self.producer.get(self.name(x))
        if (c is None or c.op != "linear" or c.attrs.get("bias") or self.uses[c.out] != 1
                or bias.size != c.attrs["out_features"]):
            return False
        c.attrs["bias"] = True
        c.params["bias"] = np.ascontiguousarray(bias.reshape(-1), dtype=np.float32)
        self.alias(out, c.out)
        return True

    # -- the walk ---------------------------------------------------------------------------
    def read(self, model, path: Path, name: str) -> Program:
        onnx, g = self.onnx, model.graph
        problems: dict[str, list[str]] = {}
        for k, node in enumerate(g.node):  # constants first: the patterns look at them
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                at = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                self._constant(node, at, problems, _node_label(node, k))
        fuse_gelu(onnx, g, self.consts)
        self.uses = Counter(i for n in g.node for i in n.input if i)
        self.uses.update(o.name for o in g.output)
        for k, node in enumerate(g.node):
            label = _node_label(node, k)
            at = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            at = {key: (v.decode() if isinstance(v, bytes) else v) for key, v in at.items()}
            if node.domain not in ("", "ai.onnx"):
                problems.setdefault(f"{node.domain}.{node.op_type}", []).append(label)
                continue
            if node.op_type == "Constant":
                continue
            if node.input and all(not i or self.const(i) is not None for i in node.input) \
                    and self._fold(node):
                continue
            importer = IMPORTERS.get(node.op_type)
            if importer is None:
                problems.setdefault(node.op_type, []).append(label)
                continue
            self._source = label
            try:
                importer(self, node, at)
            except Unsupported as e:
                problems.setdefault(str(e), []).append(label)
        if problems:
            parts = []
            for what, labels in problems.items():
                shown = ", ".join(labels[:4]) + (" ..." if len(labels) > 4 else "")
                count = f"{len(labels)} nodes" if len(labels) > 1 else "node"
                parts.append(f"{what} ({count}: {shown})")
            raise InteropError(f"{path} uses operators netdsl cannot import yet: "
                               + "; ".join(parts) + ". Nothing was written.")
        init = set(self.consts)
        inputs = []
        for vi in g.input:
            if vi.name in init:
                continue
            inputs.append((vi.name, self._input_type(vi, path)))
        outputs = [self.name(o.name) for o in g.output]
        for o in outputs:
            if o in self.consts:
                raise InteropError(f"{path}: output `{o}` is a constant; netdsl networks "
                                   "compute their outputs")
        calls = _live(self.calls, outputs)
        return Program(name, inputs, calls, outputs,
                       [self.shapes.get(o.name, ()) for o in g.output],
                       {"opset": max((o.version for o in model.opset_import
                                      if o.domain in ("", "ai.onnx")), default=0),
                        "producer": f"{model.producer_name} {model.producer_version}".strip()})

    def _fold(self, node) -> bool:
        """Evaluate a node whose inputs are all constants (a transposed weight, a computed
        shape) with onnx's reference evaluator; False if it cannot."""
        onnx = self.onnx
        try:
            from onnx.reference import ReferenceEvaluator
            ins = [i for i in node.input if i]
            feeds = {i: self.const(i) for i in ins}
            vi = [onnx.helper.make_tensor_value_info(
                i, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                for i, v in feeds.items()]
            outs = [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
                    for o in node.output]
            m = onnx.helper.make_model(onnx.helper.make_graph([node], "fold", vi, outs),
                                       opset_imports=self.opsets)
            values = ReferenceEvaluator(m).run(None, feeds)
        except Exception:  # not evaluable here: the importer table decides
            return False
        for o, v in zip(node.output, values):
            self.consts[o] = np.asarray(v)
        return True

    def _constant(self, node, at, problems, label):
        onnx = self.onnx
        if "value" in at:
            self.consts[node.output[0]] = onnx.numpy_helper.to_array(at["value"])
        elif any(k in at for k in ("value_float", "value_floats", "value_int", "value_ints")):
            k = next(k for k in at if k.startswith("value_"))
            dt = np.float32 if "float" in k else np.int64
            self.consts[node.output[0]] = np.asarray(at[k], dtype=dt)
        else:
            problems.setdefault("Constant of a sparse or string value", []).append(label)

    def _input_type(self, vi, path) -> TensorType:
        t = vi.type.tensor_type
        elem = self.onnx.TensorProto.DataType.Name(t.elem_type)
        if elem not in _DTYPE:
            raise InteropError(f"{path}: input `{vi.name}` is {elem}, which netdsl has no "
                               "type for")
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if not dims:
            raise InteropError(f"{path}: input `{vi.name}` has no batch dimension")
        if any(d is None for d in dims[1:]):
            raise InteropError(f"{path}: input `{vi.name}` has a symbolic dimension other than "
                               "the first (the batch); netdsl needs the others static")
        return TensorType((BATCH,) + tuple(dims[1:]), _DTYPE[elem])


def _live(calls: list[Call], outputs: list[str]) -> list[Call]:
    """The calls the outputs need, in order."""
    need = set(outputs)
    keep = []
    for c in reversed(calls):
        if c.out in need:
            keep.append(c)
            need.update(c.args)
    return keep[::-1]


def read_onnx(path: str | Path, name: str) -> Program:
    from netdsl.interop import require_onnx
    onnx = require_onnx()
    path = Path(path)
    try:
        model = onnx.load(str(path))
    except FileNotFoundError:
        raise InteropError(f"{path} does not exist") from None
    except Exception as e:
        raise InteropError(f"{path} is not a readable ONNX model ({type(e).__name__}: "
                           f"{e})") from None
    if model.functions:  # blocks exported as local functions (netdsl's own export does)
        import onnx.inliner
        model = onnx.inliner.inline_local_functions(model)
    return Reader(onnx, model).read(model, path, name)


KEYWORDS = set("import as block network input output loss parallel train repeat if then else "
               "return and or not true false none".split())


def net_name(text: str) -> str:
    """A netdsl name from a file stem: `resnet-18` -> `resnet_18`, `network` -> `network_`."""
    s = re.sub(r"\W", "_", text, flags=re.ASCII)
    if not s or s[0].isdigit():
        s = "net_" + s
    return s + "_" if s in KEYWORDS else s
