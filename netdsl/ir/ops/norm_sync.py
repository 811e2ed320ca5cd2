"""The running-statistics update of a batchnorm (a state update emitted by a pass, like the
optimizer's, so not callable from the language) whose batch statistics were computed
elsewhere in the graph (synchronised batchnorm across devices: see
netdsl/parallel/syncbn.py). It writes the running mean and variance in place, as
training-mode `batchnorm` does, with PyTorch's rule (unbiased variance in the running var).
"""
from netdsl.ir.registry import Arg, OpDef, Range, kernel, register


def _first(ins, a):
    return ins[0]


register(OpDef(
    "bn_running_update",
    (Arg("running_mean", "tensor"), Arg("running_var", "tensor"), Arg("mean", "tensor"),
     Arg("var", "tensor"), Arg("momentum", "float", 0.1, range=Range(0, 1)),
     Arg("count", "int", 1, range=Range(1))),
    _first, "optimizer", flops=lambda ins, out, a: 6 * out.numel(), differentiable=False,
    writes=(0, 1), view_of=0,
    doc="update batchnorm running statistics in place from a batch mean and (biased) var"))


@kernel("bn_running_update")
def _bn_running_update(xp, ins, a, ctx):
    rm, rv, mean, var = ins
    m, count = a["momentum"], a["count"]
    rm *= 1.0 - m
    rm += m * mean
    rv *= 1.0 - m
    rv += (m * count / max(count - 1, 1)) * var
    return rm
