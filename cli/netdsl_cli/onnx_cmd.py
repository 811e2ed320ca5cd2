"""`netdsl export` and `netdsl import`: ONNX out and in (netdsl.interop does the work)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from netdsl_cli.common import CountBar, JsonOpt, app, console, guard, load_network, print_json
from netdsl_cli.options import DEFAULTS, SeedOpt


def _parse_batch(value: str) -> int | None:
    from netdsl.errors import NetdslError
    if value == "dynamic":
        return None
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise NetdslError(f"--batch takes a positive integer or `dynamic`, not `{value}`")


@app.command()
def export(
    file: Annotated[Path, typer.Argument(help="a .net file", show_default=False)],
    onnx: Annotated[Path, typer.Option("--onnx", help="write the forward network here as "
                                       "ONNX (opset 17, evaluation mode)",
                                       show_default=False)],
    weights: Annotated[Path | None, typer.Option(
        "--weights", help="a checkpoint (directory or .npz) to take the weights from "
        "(default: the seeded initialisation `netdsl run` starts from)")] = None,
    batch: Annotated[str, typer.Option(
        "--batch", "-b", help="an integer to fix the batch size, or `dynamic` (symbolic N)")]
    = "dynamic",
    seed: SeedOpt = DEFAULTS.seed,
    flat: Annotated[bool, typer.Option(
        "--flat", help="no ONNX local functions for the blocks (node names still carry "
        "them)")] = False,
    half: Annotated[bool, typer.Option(
        "--half", help="weights and computation in float16 (default float32: the master "
        "weights, whatever --precision trained them)")] = False,
    json_output: JsonOpt = False,
) -> None:
    """Export a network to ONNX; the model passes onnx.checker's full check."""
    bar = CountBar("weights", json_output)
    with guard(json_output):
        from netdsl.interop import require_onnx
        from netdsl.interop.onnx_export import export_onnx
        from netdsl.interop.weights import from_checkpoint, seeded
        require_onnx()
        b = _parse_batch(batch)
        net = load_network(file)
        g = net.lower()
        if weights is not None:
            w = from_checkpoint(weights, g)
        else:
            w = seeded(seed if seed is not None else (net.train.seed if net.train else 0))
        try:
            r = export_onnx(g, w, onnx, batch=b, flat=flat, progress=bar, half=half)
        finally:
            bar.close()
        if json_output:
            print_json(r.to_json())
            return
        extra = f" (weights in {r.data_path})" if r.data_path else ""
        console().print(f"{r.path}: network {r.network}, batch {r.batch}, {r.nodes:,} ONNX "
                        f"nodes, {r.functions} block functions, {r.weights:,} weights, "
                        f"opset {r.opset}{extra}", soft_wrap=True)


@app.command("import")
def import_(
    model: Annotated[Path, typer.Argument(help="an ONNX model", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="the .net file to write",
                                         show_default=False)],
    checkpoint: Annotated[Path | None, typer.Option(
        "--checkpoint", help="where to write the weights (default: OUTPUT with .ckpt)")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="replace an edited OUTPUT or a training checkpoint in "
        "--checkpoint (refused otherwise)")] = False,
    json_output: JsonOpt = False,
) -> None:
    """Import an ONNX model as a readable .net file plus a checkpoint of its weights."""
    with guard(json_output):
        from netdsl.interop import require_onnx
        from netdsl.interop.onnx_import import import_onnx
        require_onnx()
        if json_output:
            r = import_onnx(model, output, checkpoint, overwrite)
        else:
            with console(stderr=True).status(f"importing {model}"):
                r = import_onnx(model, output, checkpoint, overwrite)
        if json_output:
            print_json(r.to_json())
            return
        console().print(f"{r.net_path}: network {r.network}, {r.lines} lines ({r.blocks} "
                        f"blocks) for {r.calls:,} operators, {r.weights:,} weights in "
                        f"{r.checkpoint}", soft_wrap=True)
        if r.trainable:
            console().print(f"train it: netdsl run {r.net_path} --checkpoint "
                            f"{r.checkpoint.parent} --resume", soft_wrap=True)
        else:
            console().print("no loss was added (the model's outputs are not one [N, K] "
                            "classifier output); add one to train it", soft_wrap=True)
