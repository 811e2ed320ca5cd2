"""`netdsl eval`: a checkpoint's loss and accuracy on held-out data (netdsl.api.evaluate)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from netdsl_cli.common import (
    CountBar,
    FileArg,
    JsonOpt,
    app,
    console,
    guard,
    load_network,
    print_json,
)
from netdsl_cli.options import DEFAULTS, BackendOpt, BatchOpt, DeviceOpt, DtypeOpt, PrecisionOpt


@app.command("eval")
def eval_(
    file: FileArg,
    checkpoint: Annotated[Path, typer.Option(
        "--checkpoint", help="a checkpoint directory (or its .npz): a run's, or the weights "
        "`netdsl import` writes", show_default=False)],
    batch: BatchOpt = DEFAULTS.batch,
    data: Annotated[str, typer.Option(
        "--data", help="test (the held-out samples) or train")] = "test",
    samples: Annotated[int | None, typer.Option(
        "--samples", min=1, help="evaluate the first N samples (default: all; of synthetic "
        "data, one batch)")] = None,
    backend: BackendOpt = DEFAULTS.backend,
    device: DeviceOpt = DEFAULTS.device,
    dtype: DtypeOpt = DEFAULTS.dtype,
    precision: PrecisionOpt = DEFAULTS.precision,
    json_output: JsonOpt = False,
) -> None:
    """Evaluate a checkpoint: loss and accuracy on the held-out data, in evaluation mode."""
    bar = CountBar("eval", json_output)
    with guard(json_output):
        from netdsl.api import evaluate
        net = load_network(file)
        try:
            r = evaluate(net, checkpoint, batch, data, samples, backend, device, dtype,
                         progress=bar, precision=precision)
        finally:
            bar.close()
        if json_output:
            print_json(r.to_json())
            return
        at = f"step {r.step:,}" if r.step is not None else "imported weights"
        scores = ", ".join(x for x in (
            None if r.loss is None else f"loss {r.loss:.4f}",
            None if r.accuracy is None else f"accuracy {r.accuracy:.4f}") if x)
        console().print(Text(f"{r.network} at {at} ({r.checkpoint}): {r.split} {scores} over "
                             f"{r.samples:,} samples, batch {r.batch} ({r.backend}, "
                             f"{r.dtype if r.precision == 'f32' else r.precision}; "
                             f"{r.images_per_s:,.0f} images/s)"), soft_wrap=True)
