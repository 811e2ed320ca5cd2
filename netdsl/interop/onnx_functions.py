"""Blocks as ONNX local functions: every block call of the exported network becomes a call
node of a model-local function, nested as the blocks nest, so Netron shows the network as
the `.net` file wrote it (a stage, its bottlenecks, their convolutions).

A block instance is the run of nodes whose scope starts with its path (`stage[2]`,
`stage[2].bottleneck[1]`). Its inputs are the values it reads from outside (activations
and its weights, which stay graph initializers), its outputs the values read after it.
Bodies use canonical names (x0.., t0.., y0..) and node names relative to the block, so
calls with the same body share one function (widths are in the weights' shapes, not in the
body: ResNet-50's 16 bottlenecks need 3 functions, identity, projection, and strided
projection); a block called with another body gets a numbered name (`bottleneck_2`).
"""
from __future__ import annotations

import re

from netdsl.ir.graph import Graph, Node

FUNCTION_DOMAIN = "netdsl.blocks"


def block_functions(onnx, g: Graph, nodes: list[Node], by_node: dict[str, list], opset: int):
    """(the main graph's nodes, the FunctionProtos) for the ONNX nodes of `nodes`."""
    ops = [n for n in nodes if not n.is_source]
    readers: dict[str, set[str]] = {}
    for n in ops:
        for v in n.inputs:
            readers.setdefault(v, set()).add(n.name)
    b = _Builder(onnx, by_node, readers, set(g.outputs.get("output", [])), opset)
    return b.level((), ops), list(b.functions.values())


class _Builder:
    def __init__(self, onnx, by_node, readers, graph_outputs, opset):
        self.onnx = onnx
        self.by_node = by_node
        self.readers = readers
        self.graph_outputs = graph_outputs
        self.opset = opset
        self.functions: dict[bytes, object] = {}  # body key -> FunctionProto
        self.names: dict[str, bytes] = {}  # function name -> body key

    def level(self, prefix: tuple[str, ...], members: list[Node]) -> list:
        out, i, d = [], 0, len(prefix)
        while i < len(members):
            n = members[i]
            if len(n.scope) == d:
                out.extend(self.by_node[n.name])
                i += 1
                continue
            child = n.scope[:d + 1]
            j = i
            while j < len(members) and members[j].scope[:d + 1] == child:
                j += 1
            if any(m.scope[:d + 1] == child for m in members[j:]):
                # not contiguous (never made by the front end): leave these nodes flat
                for m in members[i:j]:
                    out.extend(self.by_node[m.name])
            else:
                out.append(self.call(child, members[i:j]))
            i = j
        return out

    def call(self, path: tuple[str, ...], group: list[Node]):
        onnx = self.onnx
        inside = {m.name for m in group}
        inputs: list[str] = []
        for m in group:
            for v in m.inputs:
                if v not in inside and v not in inputs:
                    inputs.append(v)
        outputs = [m.name for m in group
                   if self.readers.get(m.name, set()) - inside or m.name in self.graph_outputs]
        body = self.level(path, group)
        rename = {v: f"x{k}" for k, v in enumerate(inputs)}
        rename.update({v: f"y{k}" for k, v in enumerate(outputs)})
        prefix = ".".join(path) + "."
        renamed = []
        for node in body:
            nn = onnx.NodeProto()
            nn.CopyFrom(node)
            for field in (nn.input, nn.output):
                names = [rename.setdefault(v, f"t{len(rename)}") if v else v for v in field]
                del field[:]
                field.extend(names)
            nn.name = nn.name.removeprefix(prefix)
            renamed.append(nn)
        key = self._key(renamed, len(inputs), len(outputs))
        block = re.sub(r"\[\d+\]$", "", path[-1])
        fname = self._name(block, key)
        if key not in self.functions:
            self.functions[key] = onnx.helper.make_function(
                FUNCTION_DOMAIN, fname, [f"x{k}" for k in range(len(inputs))],
                [f"y{k}" for k in range(len(outputs))], renamed,
                [onnx.helper.make_opsetid("", self.opset),
                 onnx.helper.make_opsetid(FUNCTION_DOMAIN, 1)],
                doc_string=f"netdsl block `{block}`")
        site = group[0].stack[len(path) - 1] if len(group[0].stack) >= len(path) else None
        doc = f"block `{block}`" + (f" called at {site.loc}" if site is not None else "")
        return onnx.helper.make_node(self.functions[key].name, inputs, outputs,
                                     name=".".join(path), domain=FUNCTION_DOMAIN,
                                     doc_string=doc)

    def _key(self, body, n_in: int, n_out: int) -> bytes:
        parts = [f"{n_in}/{n_out}".encode()]
        for node in body:
            k = self.onnx.NodeProto()
            k.CopyFrom(node)
            k.doc_string = ""  # call sites differ; the body does not
            parts.append(k.SerializeToString(deterministic=True))
        return b"\0".join(parts)

    def _name(self, block: str, key: bytes) -> str:
        if key in self.functions:
            return self.functions[key].name
        name, k = block, 1
        while name in self.names:
            k += 1
            name = f"{block}_{k}"
        self.names[name] = key
        return name
