"""Evaluation: the forward graph in evaluation mode (batchnorm on its running statistics,
dropout off) over samples, batch by batch, on the state a training run holds
(`RunEvaluator`) or on a checkpoint's (`evaluate_checkpoint`, `netdsl eval`).

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
from netdsl.ir.graph import STATE_OPS, Graph
from netdsl.ir.precision import kernels_of_backend
from netdsl.memory.plan import make_plan, value_bytes
from netdsl.runtime import checkpoint
from netdsl.runtime.data import accuracy, batches, load_dataset
from netdsl.runtime.executor import Executor
from netdsl.runtime.run_state import RunState
from netdsl.sizes import format_bytes
from netdsl.step import room
from netdsl.step.graphs import eval_graph, eval_roles, loss_labels

SPLITS = ("test", "train")


def eval_pass(base: Executor, forward: Graph, input_names: list[str], samples, batch: int,
              acc: tuple[str, str, int] | None, execs: dict[int, Executor],
              progress=None, precision: str = "f32") -> dict:
    """The loss (rows-weighted mean over the batches, where `forward` has one) and the
    accuracy (where `acc`, from `step.graphs.loss_labels`) of `forward` over `samples` (a Split
    or DrawnSplit), in batches of `batch`, on `base`'s state. `execs` keeps an executor
    per batch size across calls (the last batch may be short); `progress(done, total)`
    is told after each batch. `precision`: the forward graph's mixed precision."""
    total = -(-len(samples) // batch)
    logits = acc[0] if acc else None
    roles = eval_roles(forward, logits)
    be = base.backend
    losses, correct, seen = [], 0, 0
    for k, arrays in enumerate(batches(samples, batch)):
        if progress is not None:
            progress(k, total)
        n = len(arrays[0])
        if n not in execs:
            execs[n] = base.with_graph(_graph(forward, n, logits, precision, be))
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


def _graph(forward: Graph, batch: int, logits: str | None, precision: str, backend) -> Graph:
    """The evaluation graph at `precision`, with the conversions of `backend`'s device."""
    return eval_graph(forward, batch, logits, precision, kernels_of_backend(backend))


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
    precision: str = "f32"

    def to_json(self) -> dict:
        return dict(self.__dict__)


def evaluate_checkpoint(forward: Graph, cfg: TrainConfig | None, where: str | Path, *,
                        batch: int | None = None, split: str = "test",
                        samples: int | None = None, backend="numpy", dtype: str = "f32",
                        progress=None, precision: str | None = None) -> EvalResult:
    """Evaluate unbound `forward` with the state of the checkpoint in `where` (a folder or
    its checkpoint.npz) on the `split` samples of the file's data (`cfg.data`; all of
    them, or the first `samples`; of synthetic data one batch), in batches of `batch`
    (default the file's), at mixed `precision` (default the file's). `backend`:
    a name or a backend object (runtime.options.backend_for)."""
    from netdsl.backends import get_backend
    cfg = cfg or TrainConfig()
    precision = precision or cfg.precision
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
    data = load_dataset(forward, cfg)
    chosen = data.test if split == "test" else data.train
    if chosen is None or len(chosen) == 0:
        raise NetdslError(f"the {data.name} data of `{forward.name}` has no held-out "
                          "samples to evaluate on; give --data train, or data with a test "
                          "split")
    batch = batch or cfg.batch
    if samples is None:  # (synthetic data's random labels say little: one batch, as a run)
        samples = batch if data.name == "synthetic" else len(chosen)
    limit = min(samples, len(chosen))
    chosen = chosen.head(limit)
    batch = min(batch, limit)
    be = get_backend(backend) if isinstance(backend, str) else backend
    if precision != "f32":
        be.check_precision(precision)
    base = Executor(_graph(forward, batch, None, precision, be), be, dtype, cfg.seed)
    checkpoint.check_holds(path, header, forward.name,
                           {k: s for k, (s, _) in base.state_spec().items()})
    base.load_state_dict(arrays, strict=False)
    start = time.perf_counter()
    rec = eval_pass(base, forward, data.input_names, chosen, batch, acc, {}, progress,
                    precision)
    seconds = time.perf_counter() - start
    step = header.get("step") if header.get("kind") != "weights" else None
    return EvalResult(forward.name, path, step, split, limit, batch, be.name, dtype,
                      seconds, limit / seconds if seconds > 0 else 0.0, rec.get("loss"),
                      rec.get("accuracy"), precision)


class RunEvaluator:
    """Evaluation during a run: the forward graph on the run's own state where the
    executor holds it under the forward graph's names, whole; else (over MPI, spread over
    the ranks; a tensor split, in shards) on a copy joined before each evaluation, on rank
    0, where its memory allows."""

    def __init__(self, executor: Executor, forward: Graph, data, batch: int, labels,
                 samples: int | None, state: RunState, rank: int = 0,
                 distributed: bool = False, seed: int = 0, precision: str = "f32"):
        self.executor, self.forward, self.data, self.batch = executor, forward, data, batch
        self.precision = precision
        self.labels, self.samples, self.state = labels, samples, state
        self.rank, self.distributed, self.seed = rank, distributed, seed
        shares = not distributed and executor.holds_state_whole()
        self.base = executor if shares else None
        self.execs: dict[int, Executor] = {}
        self.refused: str | None = None  # why a joined copy cannot fit, decided once

    def limit(self) -> int:
        """How many held-out samples an evaluation uses (RunOptions.eval_samples)."""
        have = len(self.data.test) if self.data.test is not None else 0
        want = self.samples
        if want is None:
            want = self.batch if self.data.name == "synthetic" else have
        return min(have, want)

    def evaluate(self, step: int, warnings: list[str], progress=None) -> dict:
        limit = self.limit()
        if limit == 0:
            return {}
        if self.base is not self.executor and not self._join(warnings):
            return {}
        test = self.data.test.head(limit)
        out = eval_pass(self.base, self.forward, self.data.input_names, test, self.batch,
                        self.labels, self.execs, progress, self.precision)
        return {"step": step, "eval_samples": limit, **{f"test_{k}": v for k, v in out.items()}}

    def _join(self, warnings: list[str]) -> bool:
        """The state joined into the evaluation's executor (every rank takes part); False
        where this rank has nothing to evaluate or the copy cannot fit."""
        if self.refused is None:
            self.refused = self._joined_refusal()
            if self.refused:
                warnings.append(self.refused)
        if self.refused:
            return False
        if self.base is None and self.rank == 0:  # (before the others send)
            self.base = Executor(_graph(self.forward, self.batch, None, self.precision,
                                        self.executor.backend),
                                 self.executor.backend, self.executor.dtype, self.seed)
        items = self.state.items()
        if items is None:
            return False
        self.base.load_state_items(items)
        return True

    def _joined_refusal(self) -> str:
        """Why the joined copy cannot fit in what is free on rank 0's machine now ("" if it
        can); over MPI decided on rank 0 and sent to every rank, since all of them take
        part in the gather (a run that trained its step would otherwise be killed here by
        the kernel's OOM killer, the run lost)."""
        why = ""
        if self.rank == 0:
            dtype = self.executor.dtype
            g = _graph(self.forward, self.batch, None, self.precision, self.executor.backend)
            plan = make_plan(g, eval_roles(g, None), dtype)
            # the eval executor's state and forward pass, and the entry on its way in
            need = plan.peak_bytes + max((value_bytes(n.type, dtype) for n in g.nodes
                                          if n.op in STATE_OPS), default=0)
            free = room.available_bytes(self.executor.backend)
            if free is not None and need > free:
                part = "rank" if self.distributed else "device"
                why = (f"evaluation skipped: it runs the whole model, joined from every "
                       f"{part} of the split, which needs about {format_bytes(need)} "
                       f"(its parameters and the forward pass at batch {self.batch}), "
                       f"but {format_bytes(free)} is free on its machine; use "
                       "--eval-samples 0 not to evaluate, or evaluate a checkpoint "
                       "afterwards with `netdsl eval`")
        if not self.distributed:
            return why
        from netdsl.runtime.mpi import bcast
        return bcast(why)
