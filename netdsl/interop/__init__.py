"""Models in and out of netdsl: ONNX export (`onnx_export`) and import (`onnx_import`).

The only package that imports `onnx`; it does so lazily (`require_onnx`), so netdsl works
without the `onnx` extra and says how to install it when a command needs it.
"""
from __future__ import annotations

from netdsl.errors import InteropError


def require_onnx():
    """The `onnx` module, or an InteropError naming the extra to install."""
    try:
        import onnx
    except ImportError:
        raise InteropError("this command needs the `onnx` package, which is not installed; "
                           "install netdsl's onnx extra: pip install 'netdsl[onnx]'") from None
    return onnx
