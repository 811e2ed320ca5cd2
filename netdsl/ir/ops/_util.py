"""Small helpers shared by the operator definitions."""
from __future__ import annotations

from netdsl.errors import ShapeError
from netdsl.ir.types import Dim, TensorType


def pair(v) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ShapeError(f"expected an int or a pair of ints, got {tuple(v)}")
        return int(v[0]), int(v[1])
    return int(v), int(v)


def numel(t: TensorType, batch: int = 1) -> int:
    return t.bind(batch).numel() if t.symbolic else t.numel()


def need_rank(t: TensorType, op: str, ranks: tuple[int, ...], arg: str = "x") -> None:
    if t.rank not in ranks:
        want = " or ".join(f"{r}-d" for r in ranks)
        raise ShapeError(f"{op} expects a {want} input, but {{{arg}}} is {t}")


def need_float(t: TensorType, op: str, arg: str = "x") -> None:
    if not t.is_float:
        raise ShapeError(f"{op} expects a floating-point input, but {{{arg}}} is {t}")


def norm_axis(axis: int, rank: int, op: str) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"{op}: axis {axis} is out of range for a {rank}-d tensor")
    return axis % rank


def broadcast(a: TensorType, b: TensorType, op: str) -> tuple[Dim, ...]:
    """NumPy broadcasting of two shapes, with errors that name both operands."""
    ra, rb = a.shape[::-1], b.shape[::-1]
    out = []
    for i in range(max(len(ra), len(rb))):
        da = ra[i] if i < len(ra) else 1
        db = rb[i] if i < len(rb) else 1
        if da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        else:
            raise ShapeError(f"{op}: shapes do not match: {{a}} is {a} and {{b}} is {b}")
    return tuple(out[::-1])


def out_size(size: Dim, k: int, s: int, p: int, d: int, op: str, what: str) -> int:
    if not isinstance(size, int):
        raise ShapeError(f"{op}: the {what} dimension must be static, got {size}")
    eff = d * (k - 1) + 1
    o = (size + 2 * p - eff) // s + 1
    if o < 1:
        raise ShapeError(f"{op}: a {what} of {size} is too small for kernel {k} "
                         f"(dilation {d}) with padding {p}; {{x}} would become empty")
    return o


def grad_shape(op: str):
    """The shape rule of an elementwise backward op `op(dy, v)`: dy and the forward value
    (input or output) it pairs with have one shape, which dx has."""
    def shape(ins, a):
        dy, v = ins
        if dy.shape != v.shape:
            raise ShapeError(f"{op}: gradient {dy} and value {v} differ in shape")
        return TensorType(dy.shape, dy.dtype)
    return shape


def scratch_rule(k: float, of: int | None = None):
    """A workspace rule: k float32 copies of the result (or of input `of`), what the NumPy
    reference kernel holds at once besides its inputs and result (a bool mask counts 0.25),
    measured with tracemalloc (tests/test_plan.py). Where the fused kernels run they take
    no more, and a plan must hold with either."""
    def rule(ins, out, a):
        return int(k * 4 * (out if of is None else ins[of]).numel())
    return rule


def matmul(xp, a, b, out=None, fast=None, accumulate=False, bias=None, residual=None):
    """a @ b (into `out` if given; added to it with `accumulate`), plus `bias` along the
    last axis if given, plus `residual` (of the result's shape) if given: on the fused
    kernels' threads where they take the product (the bias and the residual added by each
    thread to its block while it is in cache; netdsl.backends.numpy_fused_gemm), else
    xp.matmul and adds. The same sums either way."""
    if fast is not None:
        y = fast.matmul(a, b, out, accumulate, bias, residual)
        if y is not None:
            return y
    if accumulate:
        out += xp.matmul(a, b)
        y = out
    else:
        y = xp.matmul(a, b, out=out)
    if bias is not None:
        y += bias
    if residual is not None:
        y += residual
    return y


def computable(xp, x):
    """x as NumPy's reference code computes with it: a bf16 or f16 array (mixed precision)
    as float32, which einsum and the BLAS take; others as they are. For the fallbacks of
    the kernels that read 2-byte values themselves (OpDef.reads_reduced), where the fused
    loops do not take the arrays."""
    return x.astype(xp.float32) if x.dtype.itemsize == 2 and x.dtype.kind in "fV" else x


def fused_kernels(ctx, *arrays, cuda: bool = False):
    """The backend's fused kernels (Numba loops, netdsl.backends.numpy_fused) if they take
    these arrays (float, contiguous), else None: the NumPy reference kernels run. An op
    whose kernel asks for them names the groups it calls in extra["fused_kernels"]
    (`OpDef.fused_groups`), so that the executor loads those when it is made, not inside a
    step. With `cuda`, the CuPy backend's CUDA
    kernels (netdsl.backends.cupy_fused) may answer too: the few ops that pass it call
    only methods those kernels have, with the same signatures."""
    be = getattr(ctx, "backend", None)
    f = getattr(be, "fused", None)
    if f is None and cuda:
        f = getattr(be, "cuda_fused", None)
    return f if f is not None and f.accepts(*(a for a in arrays if a is not None)) else None
