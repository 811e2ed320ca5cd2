"""One table of cases for the operators added for real models (issue 9), shared by the
finite-difference tests (test_ops_grad), the PyTorch comparison (test_torch_ops) and the
`retains` check (test_autodiff).

Each case: (op, input shapes, attributes, {input index: int bound or "bool"},
names of float inputs that must be positive: the domain of sqrt, log and pow's base).
"""
from __future__ import annotations

OP_CASES = [
    # arithmetic
    ("sqrt", [(3, 4)], {}, {}, ("in0",)),
    ("exp", [(3, 4)], {}, {}, ()),
    ("log", [(2, 3, 2)], {}, {}, ("in0",)),
    ("abs", [(3, 4)], {}, {}, ()),
    ("neg", [(3, 4)], {}, {}, ()),
    ("div", [(2, 3, 4), (3, 1)], {}, {}, ("in1",)),
    ("div", [(4,), (2, 4)], {}, {}, ("in1",)),
    ("pow", [(2, 3), (3,)], {}, {}, ("in0",)),
    ("pow", [(2, 3), ()], {}, {}, ("in0",)),
    ("maximum", [(2, 3, 4), (3, 1)], {}, {}, ()),
    ("minimum", [(4,), (2, 4)], {}, {}, ()),
    ("where", [(2, 3), (2, 3), (3,)], {}, {0: "bool"}, ()),
    ("where", [(3,), (2, 3), ()], {}, {0: "bool"}, ()),
    ("cast", [(2, 3)], {"dtype": "f64"}, {}, ()),
    # reductions
    ("mean", [(2, 3, 4)], {"axis": (1, 2), "keepdims": True}, {}, ()),
    ("sum", [(2, 3, 4)], {"axis": 1}, {}, ()),
    ("sum", [(2, 3, 4)], {"axis": (0, -1), "keepdims": True}, {}, ()),
    ("amax", [(2, 3, 4)], {"axis": -1}, {}, ()),
    ("amax", [(2, 3, 4)], {"axis": (1, 2), "keepdims": True}, {}, ()),
    ("amin", [(3, 5)], {"axis": 0}, {}, ()),
    ("log_softmax", [(2, 3, 4)], {"axis": 1}, {}, ()),
    ("log_softmax", [(3, 5)], {}, {}, ()),
    # activations
    ("relu6", [(4, 5)], {}, {}, ()),
    ("clip", [(4, 5)], {"min": -0.5, "max": 0.7}, {}, ()),
    ("clip", [(4, 5)], {"max": 0.2}, {}, ()),
    ("hardswish", [(4, 5)], {}, {}, ()),
    ("hardsigmoid", [(4, 5)], {}, {}, ()),
    ("silu", [(4, 5)], {}, {}, ()),
    ("mish", [(4, 5)], {}, {}, ()),
    ("elu", [(4, 5)], {"alpha": 0.7}, {}, ()),
    ("selu", [(4, 5)], {}, {}, ()),
    ("softplus", [(4, 5)], {}, {}, ()),
    ("softplus", [(4, 5)], {"beta": 2.0, "threshold": 1.0}, {}, ()),
    ("gelu", [(4, 5)], {"approximate": "tanh"}, {}, ()),
    ("prelu", [(2, 3, 4)], {"num_parameters": 3}, {}, ()),
    ("prelu", [(2, 3, 2, 2)], {}, {}, ()),
    # pooling
    ("maxpool", [(2, 2, 7, 6)], {"kernel": 3, "stride": 2, "padding": 1, "ceil_mode": True},
     {}, ()),
    ("maxpool", [(1, 2, 6, 6)], {"kernel": 2, "stride": 2, "ceil_mode": True}, {}, ()),
    ("avgpool", [(2, 2, 7, 6)], {"kernel": 3, "stride": 2, "padding": 1, "ceil_mode": True},
     {}, ()),
    ("avgpool", [(1, 2, 5, 7)], {"kernel": 3, "stride": 2, "padding": 1,
                                 "count_include_pad": False}, {}, ()),
    ("avgpool", [(1, 2, 6, 5)], {"kernel": (3, 2), "stride": 2, "padding": (1, 1),
                                 "ceil_mode": True, "count_include_pad": False}, {}, ()),
    ("maxpool1d", [(2, 3, 9)], {"kernel": (3,), "stride": (2,), "padding": (1,)}, {}, ()),
    ("maxpool1d", [(1, 2, 8)], {"kernel": (3,), "stride": (2,), "ceil_mode": True}, {}, ()),
    ("avgpool1d", [(2, 3, 9)], {"kernel": (3,), "padding": (1,),
                                "count_include_pad": False}, {}, ()),
    ("maxpool3d", [(1, 2, 4, 5, 4)], {"kernel": (2,), "stride": (2, 1, 2)}, {}, ()),
    ("avgpool3d", [(1, 2, 5, 4, 4)], {"kernel": (3, 2, 2), "stride": (2,), "padding": (1, 0, 1),
                                      "ceil_mode": True}, {}, ()),
    ("global_maxpool", [(2, 3, 4, 5)], {}, {}, ()),
    ("global_maxpool", [(2, 3, 5)], {}, {}, ()),
    ("adaptive_avgpool", [(2, 3, 7, 5)], {"output_size": (3, 2)}, {}, ()),
    ("adaptive_avgpool", [(1, 2, 6, 6)], {"output_size": (1,)}, {}, ()),
    ("adaptive_avgpool", [(1, 2, 5)], {"output_size": (3,)}, {}, ()),
    ("adaptive_maxpool", [(2, 3, 7, 5)], {"output_size": (3, 2)}, {}, ()),
    ("adaptive_maxpool", [(1, 2, 4, 5, 6)], {"output_size": (2, 3, 4)}, {}, ()),
    # padding and resizing
    ("pad", [(2, 3, 4, 5)], {"pads": (1, 2, 0, 3)}, {}, ()),
    ("pad", [(2, 3, 4)], {"pads": (2, 1), "value": 0.5}, {}, ()),
    ("pad", [(2, 3, 4, 5)], {"pads": (2, 1, 3, 2), "mode": "reflect"}, {}, ()),
    ("pad", [(2, 3, 4)], {"pads": (3, 2), "mode": "reflect"}, {}, ()),
    ("pad", [(1, 2, 3, 4)], {"pads": (2, 3, 4, 1), "mode": "replicate"}, {}, ()),
    ("pad", [(1, 2, 2, 3, 4)], {"pads": (1, 2, 1, 1, 2, 0), "mode": "replicate"}, {}, ()),
    ("upsample", [(2, 3, 3, 4)], {"scale_factor": 2.0}, {}, ()),
    ("upsample", [(1, 2, 5, 4)], {"size": (7, 3)}, {}, ()),
    ("upsample", [(2, 3, 3, 4)], {"scale_factor": 2.0, "mode": "bilinear"}, {}, ()),
    ("upsample", [(1, 2, 5, 4)], {"size": (7, 9), "mode": "bilinear"}, {}, ()),
    ("upsample", [(1, 2, 5, 4)], {"size": (7, 9), "mode": "bilinear", "align_corners": True},
     {}, ()),
    ("upsample", [(2, 3, 3, 4)], {"scale_factor": 2.0, "mode": "bilinear",
                                  "align_corners": True}, {}, ()),
    ("upsample", [(2, 3, 5)], {"scale_factor": 1.5, "mode": "linear"}, {}, ()),
    ("upsample", [(1, 2, 2, 3, 2)], {"size": (3, 5, 4), "mode": "trilinear"}, {}, ()),
    ("upsample", [(1, 2, 2, 3, 2)], {"scale_factor": 3.0}, {}, ()),
    # normalisation
    ("layernorm", [(2, 3, 4)], {"axis": -2}, {}, ()),
    ("layernorm", [(2, 3, 2, 2)], {"axis": 1, "affine": False}, {}, ()),
    ("groupnorm", [(2, 6, 3)], {"num_groups": 3}, {}, ()),
    ("groupnorm", [(2, 4, 2, 3)], {"num_groups": 2, "affine": False}, {}, ()),
    ("groupnorm", [(3, 4)], {"num_groups": 1}, {}, ()),
    ("instancenorm", [(2, 3, 5)], {"affine": True, "eps": 1e-3}, {}, ()),
    ("instancenorm", [(2, 3, 2, 3)], {}, {}, ()),
    ("rmsnorm", [(2, 3, 5)], {}, {}, ()),
    ("rmsnorm", [(2, 3, 4)], {"axis": 1, "eps": 1e-3}, {}, ()),
    ("rmsnorm", [(4, 5)], {"affine": False}, {}, ()),
    # shape
    ("squeeze", [(2, 1, 3, 1)], {"axis": (1, 3)}, {}, ()),
    ("squeeze", [(2, 1, 3)], {"axis": 1}, {}, ()),
    ("unsqueeze", [(2, 3)], {"axis": -1}, {}, ()),
    ("unsqueeze", [(2, 3)], {"axis": 1}, {}, ()),
    ("expand", [(2, 1, 3)], {"shape": (4, 2, 5, 3)}, {}, ()),
    ("expand", [(3, 1)], {"shape": (-1, 4)}, {}, ()),
    ("slice", [(2, 7, 3)], {"axis": 1, "start": 1, "stop": 7, "step": 2}, {}, ()),
    ("slice", [(9, 2)], {"axis": 0, "start": 0, "stop": 8, "step": 3}, {}, ()),
    ("gather", [(2, 5, 3), (4,)], {"axis": 1}, {1: 5}, ()),
    ("gather", [(5, 3), (2, 3)], {"axis": 0}, {1: 5}, ()),
    ("gather", [(2, 3, 4), (2, 2)], {"axis": -1}, {1: 4}, ()),
]


def samples() -> dict:
    """The first case of each operator, as test_autodiff's SAMPLES want them."""
    out: dict = {}
    for op, shapes, attrs, ints, _ in OP_CASES:
        out.setdefault(op, (shapes, attrs, ints))
    return out
