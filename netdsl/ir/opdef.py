"""Operator definitions: one `OpDef` per operator, registered into the table `OPS` by the
operator modules (netdsl.ir.ops), which import this module; every other layer reads the
table through netdsl.ir.registry, which imports them all.

An OpDef says how an operator is called from the language (its signature), what it
produces (shape rule), which parameters and buffers it owns, what it costs (forward FLOPs,
counted as 2 x multiply-accumulates; output and workspace bytes), its layer type (which the
memory planner uses to choose between recompute and offload), what its backward pass
retains, its effects, and - attached by the autodiff and kernel modules - its gradient
rule and kernel.

Effects are what a rewrite must know before it moves, copies or drops a node (JAX keeps them
on every equation for the same reason):
- `writes`: the inputs whose storage the kernel overwrites in place (optimizer updates write
  the parameter and its state; training-mode batchnorm writes its running statistics);
- `view_of`: the input whose storage the output may share (reshape, transpose ...), so
  writing into one is writing into the other;
- `random`: the kernel draws random numbers. It draws them from `ctx.rng_for(node)`, keyed
  by (seed, step, node.meta["rng_key"] or node.name), so a copy of the node made by a
  recompute rewrite draws the same numbers as the original.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from netdsl.ir.node import SOURCE_OPS
from netdsl.ir.types import TensorType

REQUIRED = object()

# mixed precision (netdsl.passes.precision), as PyTorch's autocast lists: a "reduced" op
# has its float inputs cast to the 2-byte type and runs in it (convolutions and products,
# accumulating in f32); an "f32" op has them cast to f32 (softmax, losses, exp, log,
# sums: where 8 bits of mantissa or f16's range lose the result); a "follow" op runs in
# the type of its inputs (the widest, where they differ), its reductions in f32
PRECISIONS = ("reduced", "f32", "follow")
# The kinds of kernels an op may read 2-byte values with (`OpDef.reads_reduced`): "cpu"
# (NumPy's reference kernels), "numba" (the NumPy backend's fused loops) and "gpu" (CuPy,
# cuBLAS, cuDNN). An op whose kernels move values without computing on them reads them
# on any; the products cuBLAS and cuDNN run on 2-byte data on a GPU (accumulating in
# f32); the fused loops that read bf16 bits (numpy_fused_bf16)
ANY_DEVICE = ("cpu", "numba", "gpu")
GPU_LIBRARIES = ("gpu",)
FUSED_LOOPS = ("numba",)  # (bf16 only: netdsl.ir.precision.converted)

# layer types; the memory planner picks offload for compute-heavy ones, recompute for cheap
LAYER_TYPES = ("input", "param", "conv", "linear", "matmul", "norm", "activation", "pool",
               "elementwise", "shape", "loss", "embedding", "reduce", "dropout",
               "backward", "optimizer", "transfer", "other")


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric attribute: lo <= v <= hi, or lo < v with `lo_open`,
    v < hi with `hi_open`. Floats must also be finite; ints must fit in 64 bits."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def __str__(self) -> str:
        def num(x):
            return str(int(x)) if float(x).is_integer() else str(x)
        if self.lo is not None and self.hi is not None:
            return (f"{'(' if self.lo_open else '['}{num(self.lo)}, {num(self.hi)}"
                    f"{')' if self.hi_open else ']'}")
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {num(self.lo)}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {num(self.hi)}"
        return "any"


POSITIVE = Range(1)  # sizes, counts, strides
NON_NEGATIVE = Range(0)  # paddings, starts
PROBABILITY = Range(0, 1)  # dropout p (1 zeroes everything)
GT0 = Range(0, lo_open=True)  # epsilons


@dataclass(frozen=True)
class Arg:
    """One argument of an operator as the language sees it.

    kind: tensor | tensors (variadic) | int | float | bool | str | ints (int or tuple of
    ints) | pair (int or 2-tuple, expanded to a 2-tuple) | shape (tuple of dims, may hold N
    and -1) | axis (int, may be negative).
    """

    name: str
    kind: str
    default: Any = REQUIRED
    choices: tuple | None = None
    # valid values of an int/float attribute, or of each int of a pair/ints; None: any
    # finite float or 64-bit int. The front end checks it and docs/gen_ops.py lists it.
    range: Range | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    init: str  # kaiming_normal | kaiming_uniform | zeros | ones | normal | uniform_fan_in
    #            | constant (every element `value`)
    fan_in: int = 1
    buffer: bool = False  # buffers (BN running stats) are state, not trained
    dtype: str = "f32"
    value: float = 0.0  # for init="constant"


def _zero(*_a, **_k) -> int:
    return 0


@dataclass
class OpDef:
    name: str
    signature: tuple[Arg, ...]
    shape: Callable[..., TensorType]  # (input types, attrs) -> output type; raises ShapeError
    layer_type: str
    params: Callable[..., dict[str, ParamSpec]] = lambda ins, attrs: {}
    flops: Callable[..., int] = _zero  # (input types, out type, attrs) -> FLOPs (2 x MACs)
    workspace: Callable[..., int] = _zero  # (input types, out type, attrs) -> bytes
    # what the backward pass reads of the forward: "inputs", "input0", "output", "mask",
    # "params"... (Chainer's retain_inputs/retain_outputs)
    retains: tuple[str, ...] = ()
    doc: str = ""
    differentiable: bool = True
    # effects (see the module docstring): input indices written in place, or a function of
    # the node giving them; the input the output may alias; whether the kernel draws RNG
    writes: tuple[int, ...] | Callable[[Any], tuple[int, ...]] = ()
    view_of: int | None = None
    random: bool = False
    # how it runs under mixed precision (PRECISIONS above; extra["output_attrs"]: the
    # attributes its value holds as they are, which f16 must hold), and the kinds of
    # kernels (ANY_DEVICE) that read and write 2-byte values themselves; elsewhere the
    # executor converts them to f32 at the kernel's boundary (and the plan counts the
    # copies as the node's workspace)
    precision: str = "follow"
    reads_reduced: tuple[str, ...] = ()
    # reads only the part of its input that it outputs (slice): the cost model counts the
    # output's bytes read and written, not the whole input's
    reads_part: bool = False
    # attached later by netdsl.passes.autodiff / the kernel modules
    grad: Callable | None = None
    kernel: Callable | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def op_is_source(self) -> bool:
        return self.name in SOURCE_OPS

    @property
    def callable_from_language(self) -> bool:
        """Forward operators only: not sources, backward, optimizer or transfer nodes,
        nor forward ones marked `internal` (those are emitted by passes)."""
        return not self.op_is_source and self.layer_type not in (
            "backward", "optimizer", "transfer") and not self.extra.get("internal")

    def written_inputs(self, node) -> tuple[int, ...]:
        """Indices into `node.inputs` that running `node` overwrites in place."""
        w = self.writes
        if not w:  # most ops: nothing written
            return ()
        idx = w(node) if callable(w) else w
        return tuple(i for i in idx if i < len(node.inputs))  # optional inputs may be absent

    def fused_groups(self, node, graph) -> tuple[str, ...]:
        """The fused CPU kernel groups (netdsl.backends.numpy_fused.KERNEL_GROUPS) `node`
        (in `graph`) may call, loaded when an executor is made, not inside a step:
        extra["fused_kernels"], a tuple or a function of the node and its inputs' types
        (a convolution's depend on its geometry and shapes); () for none."""
        spec = self.extra.get("fused_kernels", ())
        return spec(node, [graph[i].type for i in node.inputs]) if callable(spec) else spec

    def moved_bytes(self, out: int, ins) -> int:
        """Bytes a run of the node reads and writes (the roofline's memory side): its
        output and its tensor inputs (`ins`, their byte counts)."""
        return 2 * out if self.reads_part else out + sum(ins)

    def adds_storage(self, node) -> bool:
        """Whether `node`'s value takes storage of its own. An in-place update's value is
        the input it overwrote (`view_of` among `writes`): it adds nothing. Every other
        value is counted as its own buffer - views too, so counts never under-state."""
        return not (self.view_of is not None and self.view_of in self.written_inputs(node))

    @property
    def pure(self) -> bool:
        """No in-place writes and no randomness: running it twice gives the same value and
        changes nothing else, so a rewrite may copy, move or drop it freely."""
        return not self.writes and not self.random

    # The three below run several times per node the front end adds; they are computed
    # once per signature (an OpDef's signature is not changed after registration, but a
    # new one is noticed: the cache is keyed by it).
    def _split(self) -> tuple[tuple[Arg, ...], tuple[Arg, ...], bool]:
        cached = self.__dict__.get("_split_cache")
        if cached is None or cached[0] is not self.signature:
            sig = self.signature
            cached = (sig, tuple(a for a in sig if a.kind in ("tensor", "tensors")),
                      tuple(a for a in sig if a.kind not in ("tensor", "tensors")),
                      any(a.kind == "tensors" for a in sig),
                      tuple(a.name for a in sig),
                      next((a.name for a in sig if a.kind == "tensors"), None))
            self.__dict__["_split_cache"] = cached
        return cached[1:]

    @property
    def tensor_args(self) -> tuple[Arg, ...]:
        return self._split()[0]

    def n_tensor_inputs(self, n_inputs: int) -> int:
        """How many of a node's inputs are tensor arguments; the rest are its parameters
        and buffers, in the order `params()` lists them."""
        cached = self.__dict__.get("_split_cache")
        if cached is None or cached[0] is not self.signature:
            self._split()
            cached = self.__dict__["_split_cache"]
        return n_inputs if cached[3] else len(cached[1])

    @property
    def attr_args(self) -> tuple[Arg, ...]:
        return self._split()[1]

    @property
    def arg_names(self) -> tuple[str, ...]:
        """The names of all arguments, in signature order."""
        return self._split()[3]

    @property
    def variadic_arg(self) -> str | None:
        """The name of the `tensors` argument that takes any number of tensors, if any."""
        return self._split()[4]


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"operator {op.name!r} registered twice")
    if op.layer_type not in LAYER_TYPES:
        raise ValueError(f"unknown layer type {op.layer_type!r}")
    if op.precision not in PRECISIONS:
        raise ValueError(f"unknown precision rule {op.precision!r}")
    OPS[op.name] = op
    return op


def kernel(name: str):
    """Decorator attaching a forward kernel `(xp, inputs, attrs, ctx) -> array` to an op."""
    def deco(fn):
        OPS[name].kernel = fn
        return fn
    return deco


def grad_rule(name: str):
    """Decorator attaching a gradient rule to an op (see netdsl.passes.autodiff)."""
    def deco(fn):
        OPS[name].grad = fn
        return fn
    return deco

