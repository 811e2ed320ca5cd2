"""Evaluation: the forward graph in evaluation mode (batchnorm on its running statistics,
dropout off) over samples, batch by batch, on the state a training run holds
(`Trainer.evaluate`) or on a checkpoint's (`evaluate_checkpoint`, `netdsl eval`).

A checkpoint is read for the forward graph's entries only (parameters and buffers; a
run's optimizer state stays on disk), at the evaluation's dtype whatever the file's, so a
float64 run's checkpoint evaluates in float32 and the weights `netdsl import` writes
evaluate as they are.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from netdsl.config import TrainConfig
from netdsl.errors import NetdslError
from netdsl.ir.graph import Graph
from netdsl.runtime import checkpoint
from netdsl.runtime.data import Split, accuracy, batches, loss_labels, make_dataset
from netdsl.runtime.executor import Executor

SPLITS = ("test", "train")


def eval_pass(base: Executor, forward: Graph, input_names: list[str], samples, batch: int,
              acc: tuple[str, str, int] | None, execs: dict[int, Executor],
              progress=None) -> dict:
    """The loss (rows-weighted mean over the batches, where `forward` has one) and the
    accuracy (where `acc`, from `data.loss_labels`) of `forward` over `samples` (a Split
    or DrawnSplit), in batches of `batch`, on `base`'s state. `execs` keeps an executor
    per batch size across calls (the last batch may be short); `progress(done, total)`
    is told after each batch."""
    total = -(-len(samples) // batch)
    roles = tuple(r for r in ("output", "loss", "logits")
                  if r in forward.outputs or (r == "logits" and acc))
    be = base.backend
    losses, correct, seen = [], 0, 0
    for k, arrays in enumerate(batches(samples, batch)):
        if progress is not None:
            progress(k, total)
        n = len(arrays[0])
        if n not in execs:
            g = forward.bind(n)
            if acc:
                g.outputs["logits"] = [acc[0]]
            execs[n] = base.with_graph(g)
        feeds = {x: a for x, a in zip(input_names, arrays, strict=True) if a is not None}
        out = execs[n].run(feeds, training=False, roles=roles)
        if "loss" in out:
            losses.append((float(be.to_host(out["loss"][0])), n))
        if acc:
            c, m = accuracy(be.to_host(out["logits"][0]), acc[2],
                            arrays[input_names.index(acc[1])])
            correct += c
            seen += m
    if progress is not None:
        progress(total, total)
    rec = {}
    if losses:
        rec["loss"] = sum(v * n for v, n in losses) / sum(n for _, n in losses)
    if seen:
        rec["accuracy"] = correct / seen
    return rec


@dataclass
class EvalResult:
    network: str
    checkpoint: str
    step: int | None  # the training step the checkpoint was saved at (None: weights only)
    split: str  # "test" or "train"
    samples: int
    batch: int
    backend: str
    dtype: str
    seconds: float
    images_per_s: float
    loss: float | None = None
    accuracy: float | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def evaluate_checkpoint(forward: Graph, cfg: TrainConfig | None, where: str | Path, *,
                        batch: int | None = None, split: str = "test",
                        samples: int | None = None, backend="numpy", dtype: str = "f32",
                        progress=None) -> EvalResult:
    """Evaluate unbound `forward` with the state of the checkpoint in `where` (a folder or
    its checkpoint.npz) on the `split` samples of the file's data (`cfg.data`; all of
    them, or the first `samples`; of synthetic data one batch), in batches of `batch`
    (default the file's). `backend`:
    a name or a backend object (runtime.options.backend_for)."""
    from netdsl.backends import get_backend
    cfg = cfg or TrainConfig()
    if split not in SPLITS:
        raise NetdslError(f"--data must be test or train, not {split!r}")
    if samples is not None and samples < 1:
        raise NetdslError(f"--samples must be at least 1, not {samples}")
    acc = loss_labels(forward)
    if "loss" not in forward.outputs and not acc:
        raise NetdslError(f"network `{forward.name}` declares no loss, so there is nothing "
                          "to evaluate it by; add e.g. `loss softmax_cross_entropy(logits, "
                          "y)`")
    arrays, header = checkpoint.load(where)
    path = str(checkpoint.file_of(where))
    data = make_dataset(forward, cfg.data, cfg.seed)
    chosen = data.test if split == "test" else data.train
    if chosen is None or len(chosen) == 0:
        raise NetdslError(f"the {data.name} data of `{forward.name}` has no held-out "
                          "samples to evaluate on; give --data train, or data with a test "
                          "split")
    batch = batch or cfg.batch
    if samples is None:  # (synthetic data's random labels say little: one batch, as a run)
        samples = batch if data.name == "synthetic" else len(chosen)
    limit = min(samples, len(chosen))
    chosen = Split(chosen.take(slice(0, limit)))
    batch = min(batch, limit)
    be = get_backend(backend) if isinstance(backend, str) else backend
    base = Executor(forward.bind(batch), be, dtype, cfg.seed)
    checkpoint.check_holds(path, header, forward.name,
                           {k: s for k, (s, _) in base.state_spec().items()})
    base.load_state_dict(arrays, strict=False)
    start = time.perf_counter()
    rec = eval_pass(base, forward, data.input_names, chosen, batch, acc, {}, progress)
    seconds = time.perf_counter() - start
    step = header.get("step") if header.get("kind") != "weights" else None
    return EvalResult(forward.name, path, step, split, limit, batch, be.name, dtype,
                      seconds, limit / seconds if seconds > 0 else 0.0, rec.get("loss"),
                      rec.get("accuracy"))
