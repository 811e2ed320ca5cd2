"""Tensor types. The leading dimension of a network input may be the symbolic batch `N`."""
from __future__ import annotations

import math
from dataclasses import dataclass

BATCH = "N"  # the one symbolic dimension; `Graph.bind(batch)` replaces it by an integer
Dim = int | str

# static integers (attributes, dimensions, counts) are 64-bit signed, as in the kernels
INT_MIN, INT_MAX = -(2 ** 63), 2 ** 63 - 1

# the element types a program writes
DTYPES = {"f16": 2, "f32": 4, "f64": 8, "i32": 4, "i64": 8, "bool": 1}
# bfloat16 is made by the precision pass (netdsl.passes.precision) only: no program
# declares it, so the language's list above does not name it
ITEMSIZE = {**DTYPES, "bf16": 2}
FLOAT_DTYPES = ("f16", "f32", "f64", "bf16")
# the 2-byte floats of mixed precision: a value of one is held at its own size whatever
# the run's float dtype (--dtype), which f32 and f64 values take (RUN_FLOATS)
REDUCED_DTYPES = ("f16", "bf16")
RUN_FLOATS = ("f32", "f64")
NUMPY_DTYPE = {"f16": "float16", "f32": "float32", "f64": "float64",
               "i32": "int32", "i64": "int64", "bool": "bool", "bf16": "bfloat16"}


def accumulate_dtype(dtype: str) -> str:
    """The type a reduction over values of `dtype` accumulates and keeps its result in:
    f32 for the 2-byte floats (statistics, sums over the batch), else `dtype` itself."""
    return "f32" if dtype in REDUCED_DTYPES else dtype


def numpy_dtype(dtype: str) -> str:
    """NumPy's name of IR element type `dtype`. bfloat16 is ml_dtypes' (the NumPy type JAX
    uses), which NumPy knows by name once ml_dtypes is imported: imported here, when first
    asked for."""
    if dtype == "bf16":
        try:
            import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
        except ImportError:
            from netdsl.errors import NetdslError
            raise NetdslError("bf16 values need the ml_dtypes package (a dependency of "
                              "netdsl: pip install ml_dtypes)") from None
    return NUMPY_DTYPE[dtype]


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str = "f32"

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def symbolic(self) -> bool:
        try:  # asked millions of times by the passes over a big step: worked out once
            return self.__dict__["_symbolic"]
        except KeyError:
            s = not all(isinstance(d, int) for d in self.shape)
            object.__setattr__(self, "_symbolic", s)  # (a cache: not a field)
            return s

    def bind(self, batch: int) -> TensorType:
        if not self.symbolic:
            return self
        return TensorType(tuple(bind_dim(d, batch) for d in self.shape), self.dtype)

    def numel(self, batch: int | None = None) -> int:
        if batch is None:
            try:  # (as `symbolic`)
                return self.__dict__["_numel"]
            except KeyError:
                pass
        t = self.bind(batch) if batch is not None else self
        if t.symbolic:
            raise ValueError(f"type {self} has a symbolic dimension; bind a batch first")
        n = math.prod(t.shape)
        if batch is None:
            object.__setattr__(self, "_numel", n)
        return n

    def nbytes(self, batch: int | None = None) -> int:
        return self.numel(batch) * ITEMSIZE[self.dtype]

    def size_error(self) -> str | None:
        """Why this type cannot exist (its bytes, with N = 1, do not fit in 64 bits)."""
        shape = self.shape
        n = math.prod(d for d in shape if isinstance(d, int)) if self.symbolic else \
            math.prod(shape)
        if n * ITEMSIZE.get(self.dtype, 1) > INT_MAX:
            return (f"a tensor {self} would hold {n:.3g} elements, more than any memory "
                    "(at most 2**63 bytes)")
        return None

    def with_dtype(self, dtype: str) -> TensorType:
        return TensorType(self.shape, dtype)

    @staticmethod
    def parse(text: str) -> TensorType:
        """Inverse of `str()`: 'f32[N, 3]' -> TensorType(('N', 3), 'f32')."""
        dtype, rest = text.split("[", 1)
        body = rest.rstrip("]").strip()
        dims: list[Dim] = []
        for part in body.split(",") if body else []:
            part = part.strip()
            dims.append(int(part) if part.lstrip("-").isdigit() else part)
        return TensorType(tuple(dims), dtype)


def mul_dims(dims) -> Dim:
    """Product of dims; symbolic if any is symbolic (e.g. 'N*64')."""
    ints = [d for d in dims if isinstance(d, int)]
    syms = [d for d in dims if not isinstance(d, int)]
    p = math.prod(ints)
    if not syms:
        return p
    if p == 1:
        return "*".join(syms)
    return "*".join(syms + [str(p)])


def bind_dim(d: Dim, batch: int) -> int:
    if isinstance(d, int):
        return d
    return math.prod(batch if f == BATCH else int(f) for f in d.split("*"))
