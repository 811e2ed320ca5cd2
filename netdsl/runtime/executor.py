"""Run a graph with a backend: persistent state, per-node dispatch, a storage plan followed
and checked.

`Executor(graph, backend)` owns the graph's persistent state - parameters, buffers (BN
running statistics) and optimizer state - initialised from each node's `init` attribute
(deterministically from `seed` and the node's name, so the same parameter gets the same
values in any graph that contains it). `run(feeds, training)` executes the nodes the
requested outputs need, like torch.fx's Interpreter, following the storage plan
`memory.plan.make_plan` makes for those outputs (the schedule, what to free after each
node, every value's bytes and memory space):

- each value is dropped right after its last reader runs;
- the executor counts the bytes it holds by the plan's one accounting rule, per device and
  in the host pool (`bytes_current`, `peak_bytes`, `bytes_by_device`, `peak_by_device`,
  `host_peak_bytes`), and checks every value a kernel returns against the bytes the plan
  gave it: the count cannot drift from the prediction without an error naming the node;
- with `arena=True` every device value lives at its planned offset in one block
  allocated once per plan (kernel results are written into their slots), so a step
  allocates no value storage of its own;
- any kernel exception is re-raised as a NetdslError naming the node and its source line;
- with `check_numerics=True` it stops at the first node that produces NaN or Inf.
"""
from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from netdsl.backends import Backend, get_backend
from netdsl.errors import CheckpointError, NetdslError, NonFinite
from netdsl.ir import registry
from netdsl.ir.graph import STATE_OPS, Graph, Node
from netdsl.ir.ops.comm import COLLECTIVES
from netdsl.ir.placement import Shard, canonical, devices_of, state_layout
from netdsl.ir.precision import converted, kernels_of_backend
from netdsl.ir.printer import node_line
from netdsl.ir.types import REDUCED_DTYPES, RUN_FLOATS, TensorType, numpy_dtype
from netdsl.memory.liveness import RUN_ONLY_ROLES, kept
from netdsl.memory.plan import HOST, MemoryPlan, device_workspaces, make_plan, space_of
from netdsl.parallel.fanout import cores
from netdsl.runtime.comm import Communicator, InProcess
from netdsl.runtime.replay import StepReplay, wanted
from netdsl.runtime.state_parts import StateParts
from netdsl.sizes import format_bytes

# output roles a training step computes that an evaluation (training=False) leaves out
TRAINING_ONLY_ROLES = ("grads", "updates", "state_updates", "comm")
_STATE, _INPUT, _OP = "state", "input", "op"  # the kinds of node the run loop tells apart
# ... and, under mixed precision, an op whose 2-byte values are converted around its kernel
# (netdsl.ir.precision), an update the f16 loss scale's flag may skip (meta "gate"), and
# the flag (read back as it is made: the updates it gates do not read it as an input)
_CONVERT, _GATED, _FLAG = "convert", "gated", "flag"
_AFTER_COMM = "after comm"  # reads a collective's result that may still be in flight


@dataclass
class KernelContext:
    """What a kernel may use besides its inputs and attributes."""

    training: bool
    backend: Backend
    float_dtype: str  # numpy name of the executor's float dtype
    node: Node | None = None
    scratch: dict[str, Any] = field(default_factory=dict)  # per-node storage, by node name

    seed: int = 0
    step: int = 0
    comm: Any = None  # the communicator of `send`, `recv` and the collectives
    # the planned slot of the node being run (arena mode; None otherwise): a kernel may
    # write its result there (`into`) and return it, saving the copy into the slot
    out: Any = None
    # the run is being recorded as a CUDA graph (netdsl.runtime.replay): nothing may read
    # a device value back to the host, so kernels skip such checks (they ran on the
    # first, unrecorded run)
    capturing: bool = False
    # a one-element device array holding `step`, where the backend draws on the device
    # (`device_rng`): a recorded step reads it when replayed, so each replay draws anew
    step_buffer: Any = None

    def into(self, ufunc, *args):
        """`ufunc(*args)`, written into the node's planned slot when it has one."""
        return ufunc(*args) if self.out is None else ufunc(*args, out=self.out)

    def out_like(self, x):
        """The node's planned slot, or a new array like x, for a kernel to write."""
        return self.out if self.out is not None else self.backend.xp.empty_like(x)

    def erf(self, x):
        return self.backend.erf(x)

    def rng_for(self, node: Node):
        """The random generator of a node that draws (`OpDef.random`): keyed by the seed,
        the step and the node's `rng_key` (its name unless a rewrite copied it), so a
        recomputed copy draws exactly what the original drew."""
        key = zlib.crc32(str(node.meta.get("rng_key", node.name)).encode())
        if self.step_buffer is not None:
            return self.backend.device_rng(self.seed, key, self.step_buffer)
        return self.backend.rng((self.seed, self.step, key))

    def dtype_of(self, ir_dtype: str) -> str:
        """The array dtype for an IR dtype: f32 and f64 run at the executor's dtype; bf16
        and f16 (mixed precision) are their own."""
        return array_dtype(ir_dtype, self.float_dtype)


def array_dtype(ir_dtype: str, float_dtype: str) -> str:
    """The array dtype of an IR value when f32 and f64 values run at `float_dtype` (a NumPy
    name); a 2-byte float, an integer or a bool is its own."""
    return float_dtype if ir_dtype in RUN_FLOATS else numpy_dtype(ir_dtype)


def init_value(node: Node, dtype: str, seed: int, key: str | None = None) -> np.ndarray:
    """A host array for a param/buffer node, from its `init` attribute, drawn from a
    generator keyed by `seed` and `key` (the node's name by default).

    kaiming_normal: N(0, 2/fan_in) (torchvision ResNet conv init, fan_in mode, ReLU gain);
    kaiming_uniform: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (nn.Linear's weight:
    kaiming_uniform_ with a=sqrt(5)); uniform_fan_in: the same bound (torch's bias init);
    normal: N(0, 1) (nn.Embedding); zeros; ones; constant (`value`, e.g. PReLU's 0.25).
    """
    shape = tuple(node.type.shape)
    init = node.attrs.get("init", "zeros")
    fan_in = max(int(node.attrs.get("fan_in", 1) or 1), 1)
    rng = np.random.default_rng([seed, zlib.crc32((key or node.name).encode())])
    # drawn in the training dtype, not in f64 and then cast (which would double the set-up
    # peak); NumPy's generators draw f32 and f64 directly
    gen = np.dtype(dtype) if np.dtype(dtype) in (np.float32, np.float64) else np.float32
    if init == "zeros":
        v = np.zeros(shape, dtype)
    elif init == "ones":
        v = np.ones(shape, dtype)
    elif init == "constant":
        v = np.full(shape, float(node.attrs.get("value", 0.0)), dtype)
    elif init == "kaiming_normal":
        v = rng.standard_normal(shape, dtype=gen)
        v *= gen.type(math.sqrt(2.0 / fan_in))
    elif init in ("kaiming_uniform", "uniform_fan_in"):
        bound = 1.0 / math.sqrt(fan_in)
        v = rng.random(shape, dtype=gen)
        v *= gen.type(2 * bound)
        v -= gen.type(bound)
    elif init == "normal":  # `parameter(...)` nodes may carry their own std
        v = rng.standard_normal(shape, dtype=gen)
        v *= gen.type(float(node.attrs.get("std", 1.0)))
    else:
        raise NetdslError(f"unknown init `{init}` for %{node.name}", loc=node.loc)
    return v.astype(dtype, copy=False)


MAX_INIT_THREADS = 8  # the most threads that draw the initial state at once


def in_parallel(fn, items: list) -> list:
    """`fn(item)` of each item, on the host's cores at once (NumPy's generators and
    ufuncs release the interpreter's lock while they fill arrays). The initial state of a
    deep network is gigabytes of draws, each tensor from its own generator, so the values
    are those drawn one after another."""
    if len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(cores(), MAX_INIT_THREADS)) as pool:
        return list(pool.map(fn, items))


def _timed(call, times: dict[str, float]):
    """`call` that also keeps each node's kernel time in `times`."""
    def timed(n: Node, inputs: list, ctx: KernelContext):
        t0 = time.perf_counter()
        out = call(n, inputs, ctx)
        times[n.name] = time.perf_counter() - t0
        return out
    return timed


def _where(n: Node) -> str:
    return f"%{n.name} = {n.op}(...)" + (f" (from {n.loc})" if n.loc else "")


class Executor:
    """Executes a graph bound to a batch size; see the module docstring.

    `graph`: bound (`Graph.bind`); a forward, training (`autodiff`) or full training-step
    (`add_optimizer`) graph. `backend`: a Backend or its name. `dtype`: "f32" or "f64" for
    every float value and parameter. `state`: share another executor's state dict (see
    `with_graph`). `plans`: storage plans of `graph` already made, by their roles.
    """

    def __init__(self, graph: Graph, backend: Backend | str = "numpy", dtype: str = "f32",
                 seed: int = 0, check_numerics: bool = False,
                 state: dict[str, Any] | None = None, arena: bool = False,
                 budget_bytes: int | None = None, budget_includes_host: bool = False,
                 comm: Communicator | None = None,
                 plans: dict[tuple[str, ...], MemoryPlan] | None = None):
        registry.load_all()
        if dtype not in ("f32", "f64"):
            raise NetdslError(f"the executor runs in f32 or f64, not {dtype}")
        for n in graph.nodes:
            if n.type.symbolic:
                raise NetdslError(f"graph `{graph.name}` still has the symbolic batch "
                                  f"({n.name}: {n.type}); bind it first: graph.bind(batch)")
        self.graph = graph
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.xp = self.backend.xp
        groups = {g for n in graph.nodes for g in registry.OPS[n.op].fused_groups(n, graph)}
        fused = getattr(self.backend, "fused", None) if groups else None
        if fused is not None and hasattr(fused, "load"):
            # the fused kernels (Numba) this graph's ops call load now, in this dtype, not
            # inside a measured step; a first run compiles them
            fused.load(sorted(groups), (numpy_dtype(dtype),))
            if any(n.type.dtype == "bf16" for n in graph.nodes):  # (loops that read bf16)
                fused.load(sorted(groups), (numpy_dtype("bf16"),))
        if any(n.attrs.get("target") == "gpu" for n in graph.nodes):
            getattr(self.backend, "cudnn", None)  # cuDNN too (loaded and checked once)
        self.dtype = dtype
        self.np_dtype = numpy_dtype(dtype)
        self.seed = seed
        self.check_numerics = check_numerics
        # split graphs: the devices' communication, in this process unless told otherwise
        self.comm = comm if comm is not None else InProcess(self.backend)
        self.layout = state_layout(graph)
        self._devices = [self.backend.device if d == 0 else d for d in devices_of(graph)]
        self.arena = arena
        self.budget_bytes = budget_bytes  # device bytes a run may hold (None: no limit)
        self.budget_includes_host = budget_includes_host  # host and device: one memory
        self._arenas: dict[tuple[str, ...], Any] = {}
        self.host_bytes_current = 0
        self.host_peak_bytes = 0
        self.step = 0  # training runs so far; keys the random draws unless run() is told
        # nodes (the loss, the logits) whose non-finite value stops the run right there,
        # before any later node (the optimizer's updates) runs: see NonFinite
        self.stop_if_nonfinite: set[str] = set()
        self._scratch: dict[str, Any] = {}
        self._conversions: dict[str, tuple[tuple[int, ...], bool]] = {}  # (see _call_mixed)
        self._after_comm: dict[str, tuple[str, tuple[str, ...]]] = {}  # (see _call_mixed)
        # the step random draws read on a backend that draws on the device (write_step)
        self._step_buffer = (self.backend.asarray(np.zeros(1, np.int64))
                             if hasattr(self.backend, "device_rng")
                             and any(registry.OPS[n.op].random for n in graph.nodes) else None)
        # the last run's f16 loss-scale flags (netdsl.passes.precision): {flag node: whether
        # it was set, so that the updates it gates were skipped}
        self.gates: dict[str, bool] = {}
        # {node: seconds its kernel took in the last run}, kept where set to a dict
        # (runtime/timeline.py); None: not timed
        self.node_times: dict[str, float] | None = None
        self.bytes_by_device: dict[int, int] = {}
        self.peak_by_device: dict[int, int] = {}
        self.state: dict[str, Any] = {} if state is None else state
        on_host = {n.name for n in graph.nodes if n.op in STATE_OPS and space_of(n) == HOST}
        fresh = [n for n in graph.nodes if n.op in STATE_OPS and n.name not in self.state]
        for n, v in zip(fresh, in_parallel(lambda n: self._init(n, seed), fresh)):
            # (a new host array: on the CPU it is the state itself, not copied again)
            v = v if self.xp is np else self.backend.asarray(v)
            # optimizer state the plan streams from the host lives there between steps
            self.state[n.name] = self.backend.copy_to_host(v) if n.name in on_host else v
        self._state_dev = {n.name: self._dev(n) for n in graph.nodes
                           if n.op in STATE_OPS and n.name not in on_host}
        for name, dev in self._state_dev.items():
            self._alloc(dev, self.state[name].nbytes)
        self.host_bytes_current = self.host_peak_bytes = sum(
            self.state[name].nbytes for name in on_host)
        # storage plans by roles (and other per-run tables), made once: `plans` gives
        # ones already made for this graph, dtype and arena
        self._plans: dict[tuple[str, ...], MemoryPlan] = dict(plans or {})
        # NETDSL_CUDA_GRAPH=1 on CuPy: steps recorded once and replayed (runtime/replay.py)
        self.replay = StepReplay(self) if wanted(self.backend) else None

    def _init(self, n: Node, seed: int) -> np.ndarray:
        """Initial values of a state node. A copy made by a split pass draws what the
        single-device original draws (keyed by the original's name), and a shard is its
        slice of the original's values, so a split run starts where one device does."""
        dtype = self._dtype_for(n.type.dtype)
        shard = Shard.of(n)
        if shard is None:
            return init_value(n, dtype, seed, key=canonical(n.name))
        full = init_value(n.copy(type=TensorType(shard.full, n.type.dtype)), dtype, seed,
                          key=canonical(n.name))
        return shard.take(full)

    # -- accounting --------------------------------------------------------------------------
    @property
    def bytes_current(self) -> int:
        return sum(self.bytes_by_device.values())

    @property
    def peak_bytes(self) -> int:
        """High-water mark of the bytes held, summed over the devices' own peaks."""
        return sum(self.peak_by_device.values())

    def reset_peak(self) -> None:
        self.peak_by_device = dict(self.bytes_by_device)

    def _dev(self, n: Node) -> int:
        return self.backend.device if n.device is None else n.device

    def _alloc(self, dev: int, nbytes: int) -> None:
        cur = self.bytes_by_device.get(dev, 0) + nbytes
        self.bytes_by_device[dev] = cur
        if cur > self.peak_by_device.get(dev, 0):
            self.peak_by_device[dev] = cur

    def _free(self, dev: int, nbytes: int) -> None:
        self.bytes_by_device[dev] -= nbytes

    def _dtype_for(self, ir_dtype: str) -> str:
        return array_dtype(ir_dtype, self.np_dtype)

    # -- planning ----------------------------------------------------------------------------
    def plan(self, roles: tuple[str, ...]) -> MemoryPlan:
        """The storage plan this executor follows for a run of `roles`."""
        roles = tuple(roles)
        if roles not in self._plans:
            g = self.graph
            for r in roles:
                if r not in g.outputs:
                    raise NetdslError(f"graph `{g.name}` has no `{r}` outputs "
                                      f"(it has {', '.join(g.outputs) or 'none'})")
            self._plans[roles] = make_plan(g, roles, self.dtype, pack_arena=self.arena)
        return self._plans[roles]

    # -- running -----------------------------------------------------------------------------
    def run(self, feeds: dict[str, Any], training: bool = True,
            roles: tuple[str, ...] | list[str] | None = None,
            step: int | None = None) -> dict[str, list]:
        """Execute the graph; returns {role: [device arrays]} for the requested roles.

        Default roles: every output role in training; in evaluation, all but "grads" and
        "updates" (so a training graph runs forward-only in eval mode on the same state).
        Inputs not fed use their `default` attribute (e.g. the optimizer's `lr`).
        `step` keys the random draws (dropout masks); by default the number of training
        runs this executor has made.
        """
        g = self.graph
        if roles is None:
            roles = tuple(r for r in g.outputs
                          if training or r not in TRAINING_ONLY_ROLES)
        roles = tuple(roles)
        if self.replay is not None:
            return self.replay.run(feeds, training, roles, step)
        return self._run(feeds, training, roles, step)

    def _run(self, feeds: dict[str, Any], training: bool, roles: tuple[str, ...],
             step: int | None, inputs: dict[str, Any] | None = None,
             capturing: bool = False) -> dict[str, list]:
        """run()'s body; `inputs`: device arrays to use for input nodes instead of their
        feeds, `capturing`: the run is being recorded (netdsl.runtime.replay)."""
        g = self.graph
        plan = self.plan(roles)
        if step is None:
            step = self.step
        if training:
            self.step = step + 1
        self.gates = {}
        if not capturing:  # (a recording reads the buffer: replay.py writes it)
            self.write_step(step)
        ctx = KernelContext(training, self.backend, self.np_dtype, scratch=self._scratch,
                            seed=self.seed, step=step, comm=self.comm, capturing=capturing,
                            step_buffer=self._step_buffer)
        slots = self._slots(roles, plan) if self.arena else None
        values: dict[str, Any] = {}
        held: dict[str, tuple] = {}  # (bytes, where) each live value adds to the count
        # the shared scratch region of each device, reserved for the run (kernels take
        # their scratch transiently, within what their workspace rules declare)
        spaces = self._workspaces(roles, plan)
        for d, w in spaces.items():
            self._alloc(d, w)
        prog = self._program(roles, plan)
        call, feed, state, take, give = self._call, self._feed, self.state, self._take, self._give
        if self.node_times is not None:
            call = _timed(call, self.node_times)
        try:
            with self.backend.running():  # the NumPy backend's threads (numpy_fused)
                for name, n, kind, ins, nb, where, frees in prog:
                    if kind is _STATE:
                        values[name] = state[name]
                    else:
                        if slots is not None:
                            ctx.out = slots.get(name)
                        if kind is _OP:
                            v = call(n, [values[i] for i in ins], ctx)
                        elif kind is _INPUT:
                            v = inputs[name] if inputs is not None else feed(n, feeds)
                        else:
                            v = self._call_mixed(kind, n, [values[i] for i in ins], ctx,
                                                 values)
                        if nb is not None:
                            if v.nbytes != nb:
                                raise NetdslError(
                                    f"internal error: {node_line(n)} returned {v.nbytes} bytes "
                                    f"({tuple(v.shape)} {v.dtype}) but the plan holds {nb} for it")
                            if slots is not None and name in slots:
                                v = self._into_slot(v, slots[name])
                            held[name] = (nb, where)
                            take(name, nb, where)
                        values[name] = v
                    for dead in frees:
                        values.pop(dead, None)
                        h = held.pop(dead, None)
                        if h is not None:
                            give(*h)
            self.comm.finish_step()
            return {r: [values[name] for name in g.outputs[r]] for r in roles
                    if r not in RUN_ONLY_ROLES}
        finally:
            # whatever is still held (outputs handed to the caller, or the values of a run
            # that failed) is no longer the executor's
            for h in held.values():
                give(*h)
            for d, w in spaces.items():
                self._free(d, w)

    def write_step(self, step: int) -> None:
        """Put `step` in the device buffer random draws read (a backend with `device_rng`
        and a graph that draws)."""
        if self._step_buffer is not None:
            self._step_buffer.fill(step)

    def _program(self, roles: tuple[str, ...], plan: MemoryPlan) -> list[tuple]:
        """The plan as the run loop reads it, made once per roles: per node run, (name,
        node, kind, input names, planned bytes or None, where its bytes count (a device,
        or None for the host pool), the values freed after it). The loop then looks
        nothing up in the graph or the plan: the executor's own time per node 2.0 -> 1.2
        us on this CPU (bench/bench_dispatch.py), which a GPU step pays for every launch."""
        key = ("program", roles)
        if key not in self._plans:
            g = self.graph
            prog = []
            device = kernels_of_backend(self.backend)
            flags = {g[x].meta["gate"] for x in plan.order if "gate" in g[x].meta}
            for name, frees in zip(plan.order, plan.frees, strict=True):
                n = g[name]
                kind = _STATE if n.op in STATE_OPS else _INPUT if n.op == "input" else _OP
                if kind is _OP and name in flags:
                    kind = _FLAG
                elif kind is _OP and "gate" in n.meta:
                    kind = _GATED
                elif kind is _OP and (n.type.dtype in REDUCED_DTYPES
                                      or converted(g, n, device) != ((), False)):
                    kind = _CONVERT
                    self._conversions[name] = converted(g, n, device)
                reads = [i for i in n.inputs if g[i].op in COLLECTIVES]
                if self.comm.deferred and reads and kind is not _STATE:
                    self._after_comm[name] = (kind, tuple(reads))
                    kind = _AFTER_COMM
                nb = plan.sizes.get(name) if kind is not _STATE else None
                where = None if nb is None or plan.space[name] == HOST else self._dev(n)
                prog.append((name, n, kind, tuple(n.inputs), nb, where, tuple(frees)))
            self._plans[key] = prog
        return self._plans[key]

    def _call_mixed(self, kind: str, n: Node, inputs: list, ctx: KernelContext, values):
        """A node the run loop's plain call does not run: the f16 loss scale's flag, read
        back; an update skipped where it is set (its value is the unchanged parameter it
        would have written); or a kernel given f32 copies of its 2-byte inputs, whose result is
        converted to the node's type (into its planned slot where it has one). A kernel
        that reads 2-byte values itself gets them as they are; where it computed in f32
        after all (a fallback its fused loops did not take), its result is converted too.
        An f16 value that overflows becomes inf, which the loss scale's check is for.
        A node that reads a collective still in flight (a deferred communicator's) is first
        ordered after it (Communicator.wait_for), then run as its own kind says."""
        if kind is _AFTER_COMM:
            kind, reads = self._after_comm[n.name]
            self.comm.wait_for(reads)
            if kind is _OP:
                return self._call(n, inputs, ctx)
        if kind is _FLAG:
            v = self._call(n, inputs, ctx)
            self.gates[n.name] = float(self.backend.to_host(v)) > 0
            return v
        if kind is _GATED:
            if self.gates[n.meta["gate"]]:
                return values[n.inputs[registry.OPS[n.op].view_of]]
            return self._call(n, inputs, ctx)
        ins, out = self._conversions[n.name]
        for k in ins:
            inputs[k] = inputs[k].astype(self.np_dtype)
        slot = ctx.out
        if out:  # (the kernel's f32 result cannot be written into a 2-byte slot)
            ctx.out = None
        v = self._call(n, inputs, ctx)
        want = self._dtype_for(n.type.dtype)
        if v.dtype == want:
            return v
        with np.errstate(over="ignore"):
            if slot is not None:
                self.xp.copyto(slot, v, casting="unsafe")
                return slot
            return v.astype(want)

    def _workspaces(self, roles: tuple[str, ...], plan: MemoryPlan) -> dict[int, int]:
        if len(self._devices) == 1:  # one device: the plan's one region
            return {self._devices[0]: plan.workspace_bytes}
        key = ("workspaces", roles)
        if key not in self._plans:
            self._plans[key] = {self.backend.device if d == 0 else d: w for d, w in
                                device_workspaces(self.graph, plan).items()}
        return self._plans[key]

    def _take(self, name: str, nbytes: int, where: int | None) -> None:
        """A value of `nbytes` starts to be held on device `where` (None: the host pool)."""
        if where is None:
            self.host_bytes_current += nbytes
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes_current)
            if self.budget_includes_host:
                self._check_budget(name, nbytes)
        else:
            self._alloc(where, nbytes)
            if self.budget_bytes is not None:
                self._check_budget(name, nbytes)

    def _give(self, nbytes: int, where: int | None) -> None:
        if where is None:
            self.host_bytes_current -= nbytes
        else:
            self._free(where, nbytes)

    def _check_budget(self, name: str, nbytes: int) -> None:
        if self.budget_bytes is None:  # per value, per step: nothing to look up then
            return
        n = self.graph[name]
        dev = self._dev(n)
        held = self.bytes_by_device.get(dev, 0) + (
            self.host_bytes_current if self.budget_includes_host else 0)
        if held > self.budget_bytes:
            raise NetdslError(
                f"out of the memory budget at {_where(n)}: device {dev} would hold "
                f"{format_bytes(held)}, over the {format_bytes(self.budget_bytes)} budget "
                f"(this value is {format_bytes(nbytes)}). Plan the step for this budget "
                "(`netdsl run --mem` or `netdsl plan --mem`), or give more memory or a "
                "smaller batch",
                loc=n.loc, stack=n.stack)

    def _into_slot(self, v, slot):
        """The value in its planned slot: as it is if the kernel wrote it there (no other
        live value shares the slot's bytes), else copied in."""
        if v is slot or (v.shape == slot.shape and v.flags.c_contiguous
                         and self.xp.may_share_memory(v, slot)):
            return slot
        self.xp.copyto(slot, v)
        return slot

    def _slots(self, roles: tuple[str, ...], plan: MemoryPlan) -> dict[str, Any]:
        """Views at each device value's planned offset in this plan's arena (one block,
        allocated on first use). Requested outputs get no slot: they outlive the run."""
        if roles not in self._arenas:
            block = self.backend.alloc(max(plan.arena_bytes, 1))
            wanted = kept(self.graph, roles)
            self._arenas[roles] = {
                name: self.backend.view(block, off, tuple(self.graph[name].type.shape),
                                        self._dtype_for(self.graph[name].type.dtype))
                for name, off in plan.offsets.items() if name not in wanted}
        return self._arenas[roles]

    def feed_names(self) -> set[str]:
        """The feeds a run reads (a split graph's copies of an input read the input's)."""
        return {n.meta.get("feed_of", n.name) for n in self.graph.nodes if n.op == "input"}

    def _feed(self, n: Node, feeds: dict[str, Any]):
        # a split graph's copy of an input is fed the rows of the whole batch it holds
        key = n.meta.get("feed_of", n.name)
        rows = n.meta.get("rows")
        if key in feeds:
            host = feeds[key]
            if rows is not None:
                host = host[rows[0]:rows[1]]
        elif "default" in n.attrs:
            host = n.attrs["default"]
        else:
            raise NetdslError(f"input `{n.name}` ({n.type}) was not fed", loc=n.loc)
        dtype = self._dtype_for(n.type.dtype)
        if self.xp is not np and isinstance(host, self.xp.ndarray):  # already on the device
            arr = host.astype(dtype, copy=True)
        else:
            arr = self.backend.asarray(np.asarray(host), dtype=dtype)
        if tuple(arr.shape) != tuple(n.type.shape):
            raise NetdslError(f"input `{n.name}` expects shape {tuple(n.type.shape)} "
                              f"({n.type}), but the fed array has shape {tuple(arr.shape)}",
                              loc=n.loc)
        return arr

    def _call(self, n: Node, inputs: list, ctx: KernelContext):
        op = registry.OPS[n.op]
        if op.kernel is None:
            raise NetdslError(f"no kernel for `{n.op}` (node %{n.name})", loc=n.loc,
                              stack=n.stack)
        ctx.node = n
        try:
            out = op.kernel(self.xp, inputs, n.attrs, ctx)
            # host-space values (to_host: pinned host memory on a GPU) stay where they are;
            # everything else as a device array (a kernel may return a NumPy scalar)
            if not isinstance(out, self.xp.ndarray) and not (
                    op.extra.get("space") == HOST and isinstance(out, np.ndarray)):
                out = self.xp.asarray(out)
        except (NetdslError, MemoryError):  # out of memory: the trainer says it in words
            raise
        except Exception as e:
            raise NetdslError(f"while running {node_line(n)}: {type(e).__name__}: {e}",
                              loc=n.loc, stack=n.stack) from e
        if self.check_numerics or n.name in self.stop_if_nonfinite:
            self._check_finite(n, out, ctx)
        return out

    def _check_finite(self, n: Node, out, ctx: KernelContext) -> None:
        xp = np if isinstance(out, np.ndarray) else self.xp
        if self.check_numerics and out.dtype.kind == "f" and not bool(xp.isfinite(out).all()):
            bad = "NaN" if bool(xp.isnan(out).any()) else "Inf"
            raise NetdslError(f"check-numerics: {_where(n)} produced {bad} "
                              f"({n.type}, phase {n.meta.get('phase', 'forward')})",
                              loc=n.loc, stack=n.stack)
        if (n.name in self.stop_if_nonfinite and not ctx.capturing
                and not bool(xp.isfinite(out).all())):
            raise NonFinite(n.name)

    # -- state -------------------------------------------------------------------------------
    def state_parts(self) -> dict[str, StateParts]:
        """Every entry of the single-device layout as this executor holds it (see
        StateParts): over MPI a rank holds some entries, or some shards of them."""
        out = {}
        for key, names in self.layout.items():
            v = self.state[names[0]]
            first = Shard.of(self.graph[names[0]])
            if first is None:
                out[key] = StateParts(tuple(v.shape), str(v.dtype), None, {None: names[0]})
                continue
            parts: dict = {}
            for x in names:  # device 0's copy of a replicated shard
                sh = Shard.of(self.graph[x])
                parts.setdefault((sh.lo, sh.hi), x)
            out[key] = StateParts(tuple(first.full), str(v.dtype), first.axis, parts)
        return out

    def holds_state_whole(self) -> bool:
        """Whether every state entry is held whole under its single-device name (so that
        `with_graph` of the single-device graph runs on this state): not so for shards."""
        return all(names[0] == key and Shard.of(self.graph[key]) is None
                   for key, names in self.layout.items())

    def host_state(self, name: str, copy: bool = True) -> np.ndarray:
        """State node `name`'s value in host memory: a copy, or (copy=False) the array
        itself where it already is a NumPy array (to be read before the next step)."""
        v = self.state[name]
        return v if isinstance(v, np.ndarray) and not copy else self.backend.to_host(v)

    def state_items(self, copy: bool = True) -> Iterator[tuple[str, np.ndarray]]:
        """(key, host array) for every state entry in the single-device layout, one at a
        time (a checkpoint streams them): device 0's copy of a replica, shards joined."""
        for key, sp in self.state_parts().items():
            if sp.axis is None:
                yield key, self.host_state(sp.parts[None], copy)
            else:
                yield key, sp.join((r, self.host_state(x, copy=False))
                                   for r, x in sp.parts.items())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of the persistent state in the single-device layout, keyed by the
        single-device graph's names: device 0's copy of a replica, shards joined."""
        return dict(self.state_items())

    def state_spec(self) -> dict[str, tuple]:
        """Shape and dtype of every entry of `state_dict()` (without copying)."""
        return {k: (sp.shape, sp.dtype) for k, sp in self.state_parts().items()}

    def load_state_dict(self, sd: Mapping[str, Any], strict: bool = True) -> None:
        """Copy host arrays into the state (in place, so sharing executors see them). Only
        the entries this executor holds are read (a lazy checkpoint reads no others)."""
        missing = [k for k in self.layout if k not in sd]
        unexpected = [k for k in sd if k not in self.layout]
        if strict and (missing or unexpected):
            parts = [f"{what} " + ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
                     for what, names in (("missing", missing), ("unexpected", unexpected))
                     if names]
            raise CheckpointError("checkpoint does not match the graph: " + "; ".join(parts))
        self.load_state_items((k, sd[k]) for k in self.layout if k in sd)

    def load_state_items(self, items: Iterable[tuple[str, Any]]) -> None:
        """Copy (key, host array) pairs into the state, one at a time; keys this executor
        does not hold are skipped."""
        spec = self.state_spec()
        for k, v in items:
            if k not in self.layout:
                continue
            if tuple(np.shape(v)) != spec[k][0]:
                raise CheckpointError(f"checkpoint entry `{k}` has shape {tuple(np.shape(v))}, "
                                      f"the graph expects {spec[k][0]}")
            for x in self.layout[k]:  # every replica, or each shard its slice
                sh = Shard.of(self.graph[x])
                part = np.asarray(v) if sh is None else sh.take(v)
                cur = self.state[x]
                if isinstance(cur, np.ndarray):  # NumPy's, or state in (pinned) host memory
                    cur[...] = np.asarray(part, dtype=cur.dtype)
                else:
                    cur[...] = self.backend.asarray(np.asarray(part), dtype=cur.dtype)

    def with_graph(self, graph: Graph, check_numerics: bool | None = None) -> Executor:
        """An executor for another graph (e.g. the forward graph at an evaluation batch
        size) that shares this one's state: updates made by either are seen by both. Its
        byte counts start from the shared state and are its own."""
        return Executor(graph, self.backend, self.dtype, self.seed,
                        self.check_numerics if check_numerics is None else check_numerics,
                        state=self.state)
