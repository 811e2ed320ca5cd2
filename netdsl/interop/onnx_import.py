"""`netdsl import`: an ONNX model -> a readable `.net` file and its weights as a checkpoint.

Read (`onnx_read`: ONNX nodes -> netdsl calls, through the importer table), write the text
(`net_writer`: blocks and repeats fold repeated structure), then load that text with the
front end like any `.net` file and give each parameter its ONNX value: the elaborated
graph's operator nodes come in the program's order, so the k-th node gets the k-th call's
weights, with every operator and shape checked. Only when all of that succeeded are the
`.net` file and the checkpoint written.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from netdsl.errors import InteropError, NetdslError
from netdsl.interop.net_writer import write_net
from netdsl.interop.onnx_read import Program, net_name, read_onnx
from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.runtime import checkpoint

WEIGHTS_KIND = "weights"  # checkpoint header kind: initial weights, no training state


@dataclass
class ImportResult:
    net_path: Path
    checkpoint: Path
    network: str
    lines: int
    calls: int
    weights: int  # elements, parameters and buffers
    blocks: int
    trainable: bool  # has a loss (a classifier), so `netdsl run` can train it

    def to_json(self) -> dict:
        return {"net": str(self.net_path), "checkpoint": str(self.checkpoint),
                "network": self.network, "lines": self.lines, "operators": self.calls,
                "weights": self.weights, "blocks": self.blocks,
                "trainable": self.trainable}


def default_checkpoint_dir(net_path: Path) -> Path:
    """`model.net` -> `model.ckpt/` beside it (what `netdsl run --checkpoint` takes)."""
    return net_path.with_suffix(".ckpt")


def import_onnx(onnx_path: str | Path, net_path: str | Path,
                checkpoint_dir: str | Path | None = None,
                overwrite: bool = False) -> ImportResult:
    onnx_path, net_path = Path(onnx_path), Path(net_path)
    ck = Path(checkpoint_dir) if checkpoint_dir is not None else default_checkpoint_dir(net_path)
    if not overwrite:
        _refuse_training_checkpoint(ck)
    prog = read_onnx(onnx_path, net_name(net_path.stem))
    if not prog.calls:
        raise InteropError(f"{onnx_path} computes nothing netdsl can hold (no operators "
                           "between its inputs and outputs)")
    classifier = _is_classifier(prog)
    nparams = sum(v.size for c in prog.calls for v in c.params.values())
    header = [f"# Imported from {onnx_path.name} by `netdsl import` "
              f"(ONNX opset {prog.info['opset']}"
              + (f", {prog.info['producer']}" if prog.info["producer"] else "") + ").",
              f"# The weights are in {ck.name}/: "
              + (f"netdsl run {net_path.name} --checkpoint {ck.name} --resume" if classifier
                 else f"netdsl export {net_path.name} --onnx OUT --weights {ck.name}"),
              ""]
    text = write_net(prog, header, classifier)
    if classifier:
        text += ("\n# a starting point: adapt the data, optimizer and schedule to the task\n"
                 "train {\n    data      = synthetic(samples=256, test_samples=32)\n"
                 "    optimizer = sgd(lr=0.01, momentum=0.9)\n    batch     = 8\n}\n")
    from netdsl.api import loads
    try:
        net = loads(text, file=str(net_path))
    except NetdslError as e:  # the writer made a file the front end rejects: a netdsl bug
        raise InteropError("the imported network does not check (a bug in netdsl import):\n"
                           + e.render()) from None
    g = net.lower()
    arrays = _weights(prog, g)
    _check_outputs(prog, g)
    if not overwrite:
        _refuse_edited_net(net_path, text)
    try:
        net_path.parent.mkdir(parents=True, exist_ok=True)
        net_path.write_text(text, encoding="utf-8")
        ck_file = checkpoint.save(ck, arrays, {"network": g.name, "step": 0,
                                               "kind": WEIGHTS_KIND, "source": str(onnx_path)})
    except OSError as e:
        raise InteropError(f"cannot write {e.filename or net_path}: {e.strerror or e}") from None
    return ImportResult(net_path, ck_file, g.name, text.count("\n"), len(prog.calls),
                        int(nparams), text.count("\nblock "), classifier)


def _refuse_training_checkpoint(ck: Path) -> None:
    """A re-import into the folder a run has trained in would replace the training with
    the ONNX weights at its first write; a weights checkpoint (an earlier import) holds
    nothing else and is replaced."""
    if not checkpoint.path_in(ck).exists():
        return
    try:
        held = checkpoint.load(ck)[1]
    except NetdslError:
        held = {}
    if held.get("kind") == WEIGHTS_KIND:
        return
    what = (f"a training checkpoint (network `{held.get('network')}`, step "
            f"{held.get('step')})" if held else "a checkpoint that cannot be read")
    raise InteropError(f"--checkpoint {ck} already holds {what}; give --overwrite to replace "
                       "it with the imported weights, or another --checkpoint")


def _refuse_edited_net(net_path: Path, text: str) -> None:
    """The written `.net` file is a starting point meant to be edited (its train section);
    a re-import replaces it only when it is what the import wrote."""
    try:
        held = net_path.read_bytes()
    except OSError:
        return  # none there (a folder, or one it cannot read, fails at the write)
    if held != text.encode("utf-8"):
        raise InteropError(f"{net_path} already exists and is not what this import writes "
                           "(edited, or another model's); give --overwrite to replace it, "
                           "or another --output")


def _is_classifier(p: Program) -> bool:
    """One [N, K] output: add labels and a cross-entropy loss so the network trains."""
    return len(p.outputs) == 1 and len(p.output_types[0]) == 2


def _weights(p: Program, g: Graph) -> dict[str, np.ndarray]:
    # operator nodes, and the param nodes of `parameter(...)` calls, in elaboration order
    # (the scalar constants of expressions, `fill` nodes, are part of their call)
    ops = [n for n in g.nodes if not n.is_source and n.op not in ("softmax_cross_entropy", "fill")
           or n.op == "param" and n.name.rsplit(".", 1)[-1].startswith("parameter")]
    kind = lambda n: "parameter" if n.op == "param" else n.op  # noqa: E731
    if len(ops) != len(p.calls) or any(kind(n) != c.op for n, c in zip(ops, p.calls)):
        raise InteropError("the imported network's operators do not line up with the ONNX "
                           "model's (a bug in netdsl import)")
    arrays = {}
    for n, c in zip(ops, p.calls):
        for pname, value in c.params.items():
            key = n.name if c.op == "parameter" else f"{n.name}.{pname}"
            if key not in g or tuple(g[key].type.shape) != value.shape:
                raise InteropError(f"weight {key} of {c.source} does not fit the imported "
                                   "network (a bug in netdsl import)")
            arrays[key] = value
    state = [n.name for n in g.nodes if n.op in STATE_OPS]
    lacking = [s for s in state if s not in arrays]
    if lacking:
        raise InteropError("the imported network has parameters the ONNX model gives no "
                           f"value for (a bug in netdsl import): {', '.join(lacking[:5])}")
    return arrays


def _check_outputs(p: Program, g: Graph) -> None:
    for name, want in zip(g.outputs["output"], p.output_types):
        have = g[name].type.shape
        if want and tuple(have[1:]) != tuple(want[1:]):
            raise InteropError(f"output `{name}` is {g[name].type} in the imported network "
                               f"but {list(want)} in the ONNX model (a bug in netdsl import)")
