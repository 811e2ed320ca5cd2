"""The GPU backend: CuPy on one CUDA device. CuPy is imported only when this backend is made,
so the rest of netdsl runs (and imports) without it."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np

from netdsl.backends import counter_rng, cudnn, cudnn_frontend
from netdsl.backends.counter_rng import DeviceRNG
from netdsl.backends.cupy_fused import CudaKernels
from netdsl.config import env_switch
from netdsl.errors import DeviceError, NoSuchGpu

CUDA_ENV = "NETDSL_CUDA_KERNELS"

_HELP = ("Install CuPy and cuDNN for your CUDA version (`pip install netdsl[gpu]` for CUDA "
         "12, `netdsl[gpu-cuda13]` for CUDA 13) on a machine with an NVIDIA GPU and driver, "
         "or run on the CPU with the numpy backend.")


def _import_cupy():
    try:
        import cupy
    except ImportError as e:
        raise DeviceError(f"the cupy backend needs CuPy, which is not installed ({e}). "
                          + _HELP) from e
    return cupy


class CupyRNG:
    def __init__(self, cupy, key):
        self._cupy = cupy
        # RandomState takes one integer: fold a (seed, step, node) key into one
        seed = int(np.random.SeedSequence(key).generate_state(1)[0])
        self._state = cupy.random.RandomState(seed)

    def random(self, shape, dtype):
        return self._state.random_sample(tuple(shape), dtype=np.dtype(dtype))


class PoolMeter:
    """Peak bytes in use in CuPy's memory pool while it runs (an allocator hook records the
    pool's used bytes after every allocation), above what was in use when it started."""

    def __init__(self, cupy):
        self._cupy = cupy
        self.peak_bytes = 0

    def __enter__(self):
        pool = self._cupy.get_default_memory_pool()
        self._base = pool.used_bytes()
        self._hw = self._base

        def malloc(size):
            mem = pool.malloc(size)
            self._hw = max(self._hw, pool.used_bytes())
            return mem
        self._cupy.cuda.set_allocator(malloc)
        return self

    def read(self) -> int:
        self.peak_bytes = max(self.peak_bytes, self._hw - self._base)
        return self.peak_bytes

    def __exit__(self, *exc):
        self.read()
        self._cupy.cuda.set_allocator(self._cupy.get_default_memory_pool().malloc)
        return False


class CupyBackend:
    name = "cupy"
    # the CPU's Numba kernels do not apply: kernels run their xp code, except the few ops
    # that ask for `cuda_fused` too (fused_kernels(..., cuda=True))
    fused = None

    def __init__(self, device: int = 0):
        cupy = _import_cupy()
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no GPU, or a broken CUDA install
            raise DeviceError(f"the cupy backend found no usable CUDA device ({e}). "
                              + _HELP) from e
        if not 0 <= device < count:
            raise NoSuchGpu(f"the cupy backend was asked for GPU {device}, but this machine "
                              f"has {count} CUDA device(s), numbered from 0. Choose one of "
                              f"them, or run on the CPU with the numpy backend.")
        self.device = device
        self.xp = cupy
        self._dev = cupy.cuda.Device(device)
        self._dev.use()
        from cupyx.scipy.special import erf
        self._erf = erf
        # batchnorm and SGD as one launch each; NETDSL_CUDA_KERNELS=0 runs the xp code
        self.cuda_fused = CudaKernels(cupy) if env_switch(CUDA_ENV, True) else None
        self._copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._pending: dict[int, tuple] = {}  # host buffer -> (copy-done event, source)
        self._cudnn: cudnn.Convolutions | None = None
        self.cudnn_status = "not loaded (no convolution has asked for it)"

    @property
    def cudnn(self) -> cudnn.Convolutions | None:
        """cuDNN's convolutions (netdsl.backends.cudnn), loaded and checked on first use;
        None where NETDSL_CUDNN=0, where no cuDNN library loads, or where it failed its
        check: `cudnn_status` says which, and convolutions take the columns' path."""
        if self.cudnn_status.startswith("not loaded"):
            self._cudnn, self.cudnn_status = self._load_cudnn()
        return self._cudnn

    def _load_cudnn(self) -> tuple[cudnn.Convolutions | None, str]:
        cupy = self.xp
        with self._dev:
            return cudnn_frontend.open_chosen(cupy, lambda a: a.data.ptr,
                                              lambda: cupy.cuda.get_current_stream().ptr,
                                              cupy.cuda.runtime.getDevice, cupy.asarray,
                                              cupy.asnumpy)

    def nccl(self):
        """CuPy's NCCL bindings (`cupy.cuda.nccl`, used by netdsl.runtime.nccl); a
        DeviceError that says why where NCCL's library does not load."""
        try:
            from cupy.cuda import nccl
        except ImportError as e:
            raise DeviceError(f"CuPy's NCCL bindings do not import ({e})") from None
        if not getattr(nccl, "available", False):
            raise DeviceError("NCCL's library does not load: pip install nvidia-nccl-cu12 "
                              "(in netdsl[gpu])")
        return nccl

    def check_precision(self, precision: str) -> None:
        """f16 runs on every CUDA GPU CuPy supports. bf16 needs arrays of ml_dtypes'
        bfloat16 on the device, which CuPy releases before 14 do not have: refused there,
        by name, rather than failing inside the first kernel."""
        if precision != "bf16":
            return
        try:
            import ml_dtypes
            with self._dev:  # an array, a conversion and a product of the type
                z = self.xp.zeros((2, 2), dtype=ml_dtypes.bfloat16)
                (z @ z).astype(self.xp.float32)
        except Exception as e:
            raise DeviceError(f"--precision bf16 on the cupy backend needs bfloat16 arrays, "
                              f"which this CuPy ({self.xp.__version__}) does not have "
                              f"({type(e).__name__}: {e}); train with --precision f16 on "
                              "the GPU (its tensor cores and cuDNN take f16), or bf16 on "
                              "the numpy backend") from None

    def asarray(self, host_array, dtype=None):
        with self._dev:
            return self.xp.array(host_array, dtype=dtype)

    def to_host(self, arr):
        return self.xp.asnumpy(arr)

    def rng(self, key) -> CupyRNG:
        with self._dev:
            return CupyRNG(self.xp, key)

    def device_rng(self, seed: int, key: int, step) -> DeviceRNG:
        """A node's draws as a function of (seed, key, the step in the device array `step`):
        netdsl.backends.counter_rng, one kernel a draw, which a recorded step replays with
        each replay's step."""
        if getattr(self, "_uniform", None) is None:
            self._uniform = self.xp.ElementwiseKernel(**counter_rng.KERNEL)
        with self._dev:
            return DeviceRNG(self.xp, self._uniform, seed, key, step)

    def synchronize(self) -> None:
        self._dev.synchronize()

    def running(self):
        return nullcontext()

    def erf(self, x):
        return self._erf(x)

    # -- storage -------------------------------------------------------------------------------
    def alloc(self, nbytes: int):
        with self._dev:
            return self.xp.empty(nbytes, dtype=self.xp.uint8)

    def view(self, block, offset: int, shape, dtype):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return block[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def copy_to_host(self, arr, out=None):
        """Device -> pinned host memory on the copy stream; the copy overlaps the compute
        queued after it, and a later `copy_to_device` waits for it."""
        import cupyx
        if out is None:
            out = cupyx.empty_pinned(arr.shape, dtype=arr.dtype)
        # the copy stream must not start before the value is computed
        ready = self.xp.cuda.get_current_stream().record()
        self._copy_stream.wait_event(ready)
        arr.get(out=out, stream=self._copy_stream, blocking=False)
        # the source must outlive the copy: the pool could hand its memory to the compute
        # stream while the copy stream still reads it. Held until the copy is done.
        self._reap()
        self._pending[id(out)] = [self._copy_stream.record(), arr]
        return out

    def _reap(self) -> None:
        for key in [k for k, e in self._pending.items() if e[1] is not None and e[0].done]:
            if isinstance(key, tuple):  # a finished copy in: nothing waits for it
                del self._pending[key]
            else:  # a finished copy out: copy_to_device still looks for its event
                self._pending[key][1] = None

    def copy_to_device(self, host, out=None):
        """Pinned host -> device on the copy stream; the compute stream waits for it."""
        self._reap()
        done, _ = self._pending.pop(id(host), (None, None))
        if done is not None:
            self._copy_stream.wait_event(done)
        with self._dev:
            compute = self.xp.cuda.get_current_stream()
            if out is None:
                out = self.xp.empty(host.shape, dtype=host.dtype)
            # the pool hands out memory the compute stream freed, which kernels queued
            # there may still use: the copy starts after them
            self._copy_stream.wait_event(compute.record())
            out.set(host, stream=self._copy_stream)
            copied = self._copy_stream.record()
            compute.wait_event(copied)
        # the pinned source must outlive the copy too: CuPy's pinned pool hands a freed
        # buffer to the next offload at once, whose copy would overwrite it mid-read (the
        # GPU run of 2026-12-04: an offload-heavy step's gradients came out as garbage)
        self._pending[("in", id(host))] = [copied, host]
        return out

    def pin_host(self, array: np.ndarray):
        """Page-lock host memory made elsewhere (a data loader's shared-memory slot), so
        that copies from it run asynchronously; returns the call that unlocks it."""
        rt = self.xp.cuda.runtime
        ptr, size = array.ctypes.data, array.nbytes
        with self._dev:
            rt.hostRegister(ptr, size, 0)
        return lambda: rt.hostUnregister(ptr)

    def upload(self, host: np.ndarray, out) -> None:
        """Copy `host` (pinned) into the device array `out` on the copy stream, at once:
        `out` is a buffer of the caller's that no queued kernel uses (unlike
        copy_to_device's, taken from the pool), so the copy overlaps the compute queued
        before it; the compute queued after this call waits for it."""
        with self._dev:
            out.set(host, stream=self._copy_stream)
            self.xp.cuda.get_current_stream().wait_event(self._copy_stream.record())

    def memory_meter(self) -> PoolMeter:
        return PoolMeter(self.xp)

    # -- CUDA graphs (netdsl.runtime.replay) ---------------------------------------------------
    def _graph_s(self):
        # non-blocking, as CuPy's and PyTorch's captures are: on a stream that synchronises
        # with the legacy default stream, a call that syncs that stream (cudaMalloc, when
        # the pool grows) invalidates the capture. Captures on a blocking stream failed at
        # their first convolution, most likely so (docs/benchmarks.md, "The GPU").
        if getattr(self, "_graph_stream", None) is None:
            with self._dev:
                self._graph_stream = self.xp.cuda.Stream(non_blocking=True)
        return self._graph_stream

    @contextmanager
    def graph_stream(self):
        """Run the block on the graph stream, ordered after the caller's stream's work and
        before its next (a host read of the loss waits for the step). CuPy's pool keeps
        each stream's freed blocks apart, so a recorded step's scratch is only reused by
        this stream's work, which runs in order with the replays."""
        caller = self.xp.cuda.get_current_stream()
        s = self._graph_s()
        s.wait_event(caller.record())
        try:
            with s:
                yield s
        finally:
            caller.wait_event(s.record())

    def capture(self, fn):
        """(graph, fn()) with fn's launches recorded on the graph stream, not run (relaxed
        mode: the pool may still grow while recording). The capture is ended if fn fails."""
        s = self._graph_s()
        with s:
            s.begin_capture()
            try:
                out = fn()
            except BaseException:
                try:
                    s.end_capture()
                except Exception:  # an invalidated capture: ending it is all that is left
                    pass
                raise
            graph = s.end_capture()
        return graph, out

    def replay(self, graph) -> None:
        graph.launch(stream=self._graph_s())

    def __repr__(self) -> str:
        return f"CupyBackend(device={self.device})"
