"""Moving values between a device and host memory: `to_host` and `to_device`.

The offload rewrite emits them: `to_host(x)` copies a value the backward pass needs into
the host pool right after it is made, so its device storage can be freed; `to_device(h)`
copies it back ahead of its backward use. Their values live in different memory spaces
(`OpDef.extra["space"]`): a `to_host` value is counted in the host pool, never against a
device's budget. On the NumPy backend the copy is real (a separate buffer, separately
accounted), so the mechanism runs and is tested without a GPU; on CuPy it goes through
pinned host memory on a copy stream. For gradients each is the other's transpose.
"""
from netdsl.ir.opdef import ANY_DEVICE, Arg, OpDef, grad_rule, kernel, register


def _same(ins, a):
    return ins[0]


def _bytes_moved(ins, out, a):
    return 0  # no arithmetic; the cost model prices the copy from the bytes


register(OpDef("to_host", (Arg("x", "tensor"),), _same, "transfer", flops=_bytes_moved,
               extra={"space": "host"}, reads_reduced=ANY_DEVICE,
               doc="copy a device value into host memory (offload)"))
register(OpDef("to_device", (Arg("x", "tensor"),), _same, "transfer", flops=_bytes_moved,
               reads_reduced=ANY_DEVICE, doc="copy a host value back onto the device (prefetch)"))


def _dst(ins, a):
    return ins[0]


# optimizer state kept in the host pool: the update runs on a device copy (`to_device`),
# and `to_host_into(state, copy, update)` writes the updated copy back into the host
# state. It reads `update` only to name the write it follows (verify: a read of a value
# overwritten in place must name the writer).
register(OpDef("to_host_into", (Arg("dst", "tensor"), Arg("src", "tensor"),
                                Arg("after", "tensor")), _dst, "transfer",
               flops=_bytes_moved, writes=(0,), view_of=0, differentiable=False,
               extra={"space": "host"}, reads_reduced=ANY_DEVICE,
               doc="copy a device value into existing host storage (state write-back)"))


@kernel("to_host_into")
def _to_host_into(xp, ins, a, ctx):
    return ctx.backend.copy_to_host(ins[1], out=ins[0])


@kernel("to_host")
def _to_host(xp, ins, a, ctx):
    return ctx.backend.copy_to_host(ins[0])


@kernel("to_device")
def _to_device(xp, ins, a, ctx):
    return ctx.backend.copy_to_device(ins[0])


@grad_rule("to_host")
def _to_host_rule(n, b, gy):
    return [b.emit("to_device", [gy])]


@grad_rule("to_device")
def _to_device_rule(n, b, gy):
    return [b.emit("to_host", [gy])]
