"""ONNX export of the operators one at a time (small networks, onnxruntime against netdsl's
evaluation-mode forward, float32 within 1e-5 of the output's scale): every padding, pooling,
resizing and normalisation form, the activations, arithmetic and reductions, attention, and
scalar constants."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from _examples import example_feeds  # noqa: E402
from _onnx_helpers import assert_matches, calibrated_state, run_ort  # noqa: E402

import netdsl  # noqa: E402
from netdsl.interop.onnx_export import export_onnx  # noqa: E402

IMG = "input x: f32[N, 3, 9, 10]"
# (input declaration, output expression): one network per case
CASES = {
    "conv_same": (IMG, "conv2d(x, 4, kernel=(4, 3), padding=\"same\", dilation=(1, 2))"),
    "conv_asym": (IMG, "conv2d(x, 4, kernel=3, stride=2, padding=(0, 1, 2, 1))"),
    "conv_valid_groups": (IMG, "conv2d(conv2d(x, 6, kernel=1), 6, kernel=3, padding=\"valid\", "
                               "groups=3)"),
    "conv1d": ("input x: f32[N, 3, 11]", "conv1d(x, 4, kernel=3, stride=2, padding=\"valid\", "
                                         "dilation=2)"),
    "conv1d_same": ("input x: f32[N, 3, 11]", "conv1d(x, 4, kernel=4, padding=\"same\")"),
    "conv3d": ("input x: f32[N, 2, 5, 6, 7]", "conv3d(x, 3, kernel=(3, 2, 3), stride=(1, 2, 1), "
                                              "padding=(1, 0, 1))"),
    "conv_transpose2d": (IMG, "conv_transpose2d(x, 4, kernel=3, stride=2, padding=1, "
                              "output_padding=1)"),
    "conv_transpose2d_groups": (IMG, "conv_transpose2d(x, 6, kernel=(2, 3), stride=(2, 1), "
                                     "groups=3, dilation=(1, 2), bias=false)"),
    "maxpool_ceil": (IMG, "maxpool(x, 3, stride=2, ceil_mode=true)"),
    "maxpool_ceil_pad": (IMG, "maxpool(x, 3, stride=2, padding=1, ceil_mode=true)"),
    # torch drops a last window that would start in the right padding (5 -> 3, not 4)
    "pool_ceil_edge": ("input x: f32[N, 3, 5, 5]", "maxpool(x, 3, stride=2, padding=1, "
                       "ceil_mode=true) + avgpool(x, 3, stride=2, padding=1, ceil_mode=true)"),
    "avgpool_ceil": (IMG, "avgpool(x, 3, stride=2, padding=1, ceil_mode=true)"),
    "avgpool_exclude_pad": (IMG, "avgpool(x, (3, 2), stride=(2, 1), padding=(1, 1), "
                                 "count_include_pad=false)"),
    "avgpool_exclude_pad_ceil": (IMG, "avgpool(x, 3, stride=2, padding=1, ceil_mode=true, "
                                      "count_include_pad=false)"),
    "pool1d": ("input x: f32[N, 3, 11]", "maxpool1d(x, 3, stride=2, ceil_mode=true) + "
                                         "avgpool1d(x, 3, stride=2, ceil_mode=true)"),
    "pool3d": ("input x: f32[N, 2, 5, 6, 7]", "maxpool3d(x, 2), avgpool3d(x, 2, padding=1, "
                                              "stride=2, count_include_pad=false)"),
    "global_maxpool": (IMG, "global_maxpool(x)"),
    "adaptive_even": (IMG, "adaptive_avgpool(x, (3, 5)) + adaptive_maxpool(x, (3, 5))"),
    "adaptive_uneven": (IMG, "adaptive_avgpool(x, (4, 3)) + adaptive_maxpool(x, (4, 3))"),
    "adaptive_3d": ("input x: f32[N, 2, 5, 6, 7]", "adaptive_avgpool(x, (2, 3, 3)), "
                                                   "adaptive_maxpool(x, 2)"),
    "pad_constant": (IMG, "pad(x, (1, 2, 0, 3), value=0.5)"),
    "pad_reflect": (IMG, "pad(x, (2, 1, 3, 0), mode=\"reflect\")"),
    "pad_replicate": ("input x: f32[N, 3, 11]", "pad(x, (3, 2, 1, 0), mode=\"replicate\")"),
    "upsample_nearest": (IMG, "upsample(x, scale_factor=2.0)"),
    "upsample_nearest_size": (IMG, "upsample(x, size=(13, 7))"),
    "upsample_bilinear": (IMG, "upsample(x, size=(17, 23), mode=\"bilinear\")"),
    "upsample_bilinear_scale": (IMG, "upsample(x, scale_factor=1.5, mode=\"bilinear\")"),
    "upsample_align": (IMG, "upsample(x, scale_factor=2.0, mode=\"bilinear\", "
                            "align_corners=true)"),
    "upsample_linear_1d": ("input x: f32[N, 3, 11]", "upsample(x, size=5, mode=\"linear\")"),
    "upsample_trilinear": ("input x: f32[N, 2, 3, 4, 5]", "upsample(x, scale_factor=2.0, "
                                                          "mode=\"trilinear\")"),
    "groupnorm": (IMG, "groupnorm(conv2d(x, 6, kernel=1), 3)"),
    "groupnorm_plain": (IMG, "groupnorm(x, 1, affine=false, eps=0.01)"),
    "instancenorm": (IMG, "instancenorm(x) + instancenorm(x, affine=true, eps=0.1)"),
    "rmsnorm": ("input x: f32[N, 5, 6]", "rmsnorm(x) + rmsnorm(x, axis=1, affine=false)"),
    "layernorm_axes": ("input x: f32[N, 5, 6]", "layernorm(x, axis=1) + layernorm(x, "
                                                "affine=false)"),
    "activations": ("input x: f32[N, 4, 5]",
                    "relu6(3 * x) + clip(x, min=-0.5, max=0.7) + clip(x, max=0.2) + "
                    "clip(x, min=0.1) + hardswish(4 * x) + hardsigmoid(4 * x) + silu(x) + "
                    "mish(x) + elu(x, alpha=0.7) + selu(x) + gelu(x, approximate=\"tanh\")"),
    "softplus": ("input x: f32[N, 4, 5]", "softplus(x) + softplus(10 * x, beta=2.0, "
                                          "threshold=5.0)"),
    "prelu": (IMG, "prelu(x, num_parameters=3) + prelu(x)"),
    "log_softmax": ("input x: f32[N, 4, 5]", "log_softmax(x) + log_softmax(x, axis=1)"),
    "arith": ("input x: f32[N, 4, 5]",
              "(x * 0.5 - 1) / (x ** 2 + 1) + sqrt(abs(x)) + exp(-x) - log(abs(x) + 0.1) + "
              "maximum(x, x * 0.3) - minimum(x, neg(x)) + pow(abs(x) + 1, x)"),
    "where": ("input x: f32[N, 4, 5]", "where(x > 0, x, 1 - x) + where(x <= 0.5, 2 * x, x * 0) + "
                                       "cast(x >= 0, \"f32\") + cast(x < 0.2, \"f32\") + "
                                       "cast(x == x, \"f32\")"),
    "reductions": ("input x: f32[N, 4, 5, 3]",
                   "sum(x, (1, 3), keepdims=true) + amax(x, 2, keepdims=true) + "
                   "amin(x, (1, 2, 3), keepdims=true) + mean(x, (1, -1), keepdims=true)"),
    "shapes": ("input x: f32[N, 4, 1, 5]",
               "unsqueeze(squeeze(x, 2), 1) + expand(slice(x, 1, 0, 4, step=4), "
               "(N, 4, 1, -1))"),
    "gather": ("input ids: i64[N, 3]", "gather(parameter((7, 5)), ids)"),
    "gather_elements": ("input x: f32[N, 4, 5]", "gather_elements(x, cast(x > 0, \"i64\"), "
                                                 "axis=2)"),
    "attention": ("input x: f32[N, 2, 6, 4]",
                  "scaled_dot_product_attention(x, x * 0.5, x + 1, causal=true) + "
                  "scaled_dot_product_attention(x, x, x, scale=0.3) + "
                  "matmul(softmax(causal_mask(matmul(x, transpose(x)))), x)"),
    "attention_qkv": ("input x: f32[N, 5, 12]",
                      "attention_qkv(x, heads=2) + attention_qkv(x * 0.5, heads=4, causal=true) "
                      "+ attention_qkv(x, heads=1, scale=0.3) + "
                      "attention_qkv(x, attention_qkv_probs(x, heads=2, causal=true), heads=2)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_operator_matches_onnxruntime(name, tmp_path):
    decl, expr = CASES[name]
    net = netdsl.loads(f"network t {{\n  {decl}\n  output {expr}\n}}", file=f"{name}.net")
    g = net.lower(2)
    feeds = example_feeds(g)
    state = calibrated_state(g, feeds)
    export_onnx(net.lower(), lambda n: state[n.name], tmp_path / "m.onnx")
    got = run_ort(tmp_path / "m.onnx", feeds)
    assert all(np.isfinite(v).all() for v in got)
    assert_matches(got, g, state, feeds)
