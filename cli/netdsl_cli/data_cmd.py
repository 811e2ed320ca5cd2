"""`netdsl data`: the train section's data, and how fast this machine loads it
(netdsl.api.describe_data)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from netdsl.sizes import format_seconds
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
from netdsl_cli.options import DEFAULTS, BatchOpt, option


@app.command("data")
def data(
    file: FileArg,
    batch: BatchOpt = DEFAULTS.batch,
    workers: option("workers") = DEFAULTS.workers,
    bad_images: option("bad_images") = DEFAULTS.bad_images,
    batches: Annotated[int, typer.Option(
        "--batches", min=1, help="batches loaded to measure images/s")] = 8,
    png: Annotated[Path | None, typer.Option(
        "--png", help="write the first batch's first 16 samples to this PNG, 4 a row")] = None,
    save_images: Annotated[Path | None, typer.Option(
        "--save-images", help="write every sample as DIR/LABEL/N.png instead (an image "
        "folder for images(DIR))")] = None,
    json_output: JsonOpt = False,
) -> None:
    """The training data: counts, classes, a batch's shapes, samples as a PNG, images/s."""
    bar = CountBar("loading", json_output)
    with guard(json_output):
        from netdsl.api import describe_data
        net = load_network(file)
        if save_images is not None:
            from netdsl.api import save_images as save
            try:
                n = save(net, save_images, progress=bar)
            finally:
                bar.close()
            if json_output:
                print_json({"saved": n, "folder": str(save_images)})
            else:
                console().print(f"wrote {n:,} images to {save_images}")
            return
        try:
            r = describe_data(net, batch, workers, batches, bad_images, png, progress=bar)
        finally:
            bar.close()
        if json_output:
            print_json(r.to_json())
            return
        out = console()
        test = f", {r.test_samples:,} held out" if r.test_samples else ""
        name = f"{r.data} {r.name}" if r.name != r.data else r.data
        out.print(f"{r.network}: data {name}: {r.train_samples:,} training samples{test}")
        if r.classes:
            shown = ", ".join(r.classes[:10]) + (", ..." if len(r.classes) > 10 else "")
            out.print(f"classes: {len(r.classes):,} ({shown})")
        for i in r.inputs:
            out.print(f"input {i['name']}: {i['dtype']}{i['shape']}, values "
                      f"{i['min']:.4g} to {i['max']:.4g}")
        where = f"{r.workers} worker(s)" if r.workers else "in this process"
        out.print(f"loader: {r.images_per_s:,.0f} images/s ({r.batches_timed} batches of "
                  f"{r.batch} in {format_seconds(r.seconds)}, {where})")
        if r.skipped_samples:
            out.print(f"skipped {r.skipped_samples} sample(s) that cannot be read")
        if r.png:
            out.print(f"samples: {r.png}")
