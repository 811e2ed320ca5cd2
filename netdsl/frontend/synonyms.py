"""Operator names from other frameworks, mapped to netdsl's by meaning.

Edit distance suggests `transpose` for `upsample` and `relu` for `elu`; a user coming
from PyTorch or Keras needs the operator that does the same thing, or to be told there is
none. Each entry lists netdsl operators (or builtins) in order of preference; the first
that exists is suggested, so an operator added later is picked up without editing here.
"""
from __future__ import annotations

SYNONYMS: dict[str, tuple[str, ...]] = {
    # layers
    "dense": ("linear",), "fc": ("linear",), "fully_connected": ("linear",),
    "conv": ("conv2d",), "convolution": ("conv2d",), "conv2d_layer": ("conv2d",),
    "conv1d": ("conv1d", "conv2d"), "conv_transpose": ("conv_transpose2d", "conv2d_transpose"),
    "conv2d_transpose": ("conv_transpose2d",), "deconv": ("conv_transpose2d",
                                                         "conv2d_transpose"),
    "upsample": ("upsample", "interpolate", "resize", "conv_transpose2d"),
    "interpolate": ("upsample", "resize"), "resize": ("upsample", "interpolate"),
    "upsampling2d": ("upsample", "interpolate"),
    "bn": ("batchnorm",), "batch_norm": ("batchnorm",), "batchnorm2d": ("batchnorm",),
    "batchnormalization": ("batchnorm",), "ln": ("layernorm",), "layer_norm": ("layernorm",),
    "layernormalization": ("layernorm",),
    "groupnorm": ("groupnorm",), "instancenorm": ("instancenorm", "groupnorm"),
    "max_pool": ("maxpool",), "maxpool2d": ("maxpool",), "max_pool2d": ("maxpool",),
    "avg_pool": ("avgpool",), "avgpool2d": ("avgpool",), "avg_pool2d": ("avgpool",),
    "adaptive_avg_pool2d": ("global_avgpool",), "global_average_pooling2d": ("global_avgpool",),
    "gap": ("global_avgpool",), "emb": ("embedding",), "embed": ("embedding",),
    "attention": ("attention", "matmul", "softmax"), "mha": ("attention", "matmul"),
    # activations
    "swish": ("silu", "sigmoid"), "silu": ("silu", "sigmoid"), "elu": ("elu", "leaky_relu"),
    "prelu": ("prelu", "leaky_relu"), "relu6": ("relu6", "relu"), "gelu_new": ("gelu",),
    "logistic": ("sigmoid",), "log_softmax": ("log_softmax", "softmax"),
    # losses
    "cross_entropy": ("softmax_cross_entropy",), "crossentropy": ("softmax_cross_entropy",),
    "nll_loss": ("softmax_cross_entropy",), "ce": ("softmax_cross_entropy",),
    "categorical_crossentropy": ("softmax_cross_entropy",),
    "sparse_categorical_crossentropy": ("softmax_cross_entropy",),
    "mse_loss": ("mse",), "l2_loss": ("mse",), "mean_squared_error": ("mse",),
    # tensor manipulation
    "view": ("reshape",), "flatten2d": ("flatten",), "cat": ("concat",),
    "concatenate": ("concat",), "stack": ("stack", "concat"), "chunk": ("split",),
    "narrow": ("slice",), "transpose2d": ("permute",), "swapaxes": ("transpose",),
    "mm": ("matmul",), "bmm": ("matmul",), "dot": ("matmul",), "einsum": ("matmul",),
    "multiply": ("mul",), "subtract": ("sub",), "plus": ("add",), "sum": ("sum", "add"),
    "average": ("mean",), "reduce_mean": ("mean",), "weight": ("parameter",),
    "variable": ("parameter",), "zeros": ("fill",), "ones": ("fill",), "full": ("fill",),
}


def by_meaning(name: str, exists) -> str | None:
    """A hint for an undefined `name` that is a known word, else None (then spelling
    decides). `exists` says whether a netdsl name is defined."""
    key = name.lower()
    if key not in SYNONYMS:
        return None
    found = [c for c in SYNONYMS[key] if exists(c)]
    if not found:
        return f"netdsl has no `{name}` operator (see the operator table in docs/language.md)"
    if found[0] == SYNONYMS[key][0]:  # the same thing under another name
        return f"did you mean `{found[0]}`?" if found[0] == key else \
            f"netdsl calls this `{found[0]}`"
    return f"netdsl has no `{name}`; the nearest operator is `{found[0]}`"
