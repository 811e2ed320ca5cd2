"""The stdlib models against the same models built by hand in PyTorch (on the meta device,
so nothing is allocated): the parameter counts must agree exactly.

torchvision is not installed beside torch here, so its vgg16 / densenet121 / resnet are
re-stated below layer by layer, following torchvision/models/{vgg,densenet,resnet}.py.
Skipped when torch is missing (it is not a dependency of netdsl).
"""
import pytest
from _examples import load, n_params

torch = pytest.importorskip("torch")
nn = torch.nn
pytestmark = pytest.mark.torch

def count(m) -> int:
    return sum(p.numel() for p in m.parameters())


def vgg16():
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
           512, 512, 512, "M"]
    layers, c = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),
                         nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, 1000))


def densenet121(growth=32, blocks=(6, 12, 24, 16), init=64, bn_size=4):
    mods = [nn.Conv2d(3, init, 7, 2, 3, bias=False), nn.BatchNorm2d(init), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1)]
    c = init
    for i, n in enumerate(blocks):
        for _ in range(n):
            mods += [nn.BatchNorm2d(c), nn.Conv2d(c, bn_size * growth, 1, bias=False),
                     nn.BatchNorm2d(bn_size * growth),
                     nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)]
            c += growth
        if i < len(blocks) - 1:
            mods += [nn.BatchNorm2d(c), nn.Conv2d(c, c // 2, 1, bias=False)]
            c //= 2
    mods += [nn.BatchNorm2d(c), nn.Linear(c, 1000)]
    return nn.ModuleList(mods)


def bottleneck_resnet(blocks, classes=1000):
    mods = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)]
    c = 64
    for width, n in zip((64, 128, 256, 512), blocks):
        for b in range(n):
            out = 4 * width
            mods += [nn.Conv2d(c, width, 1, bias=False), nn.BatchNorm2d(width),
                     nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                     nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)]
            if b == 0:  # torchvision: a projection whenever stride != 1 or c != out
                mods += [nn.Conv2d(c, out, 1, bias=False), nn.BatchNorm2d(out)]
            c = out
    mods.append(nn.Linear(c, classes))
    return nn.ModuleList(mods)


def preact_cifar(n, classes=10):
    mods, c = [nn.Conv2d(3, 16, 3, padding=1, bias=False)], 16
    for width in (16, 32, 64):
        for b in range(n):
            out = 4 * width
            mods += [nn.BatchNorm2d(c), nn.Conv2d(c, width, 1, bias=False),
                     nn.BatchNorm2d(width), nn.Conv2d(width, width, 3, padding=1, bias=False),
                     nn.BatchNorm2d(width), nn.Conv2d(width, out, 1, bias=False)]
            if b == 0:
                mods.append(nn.Conv2d(c, out, 1, bias=False))
            c = out
    mods += [nn.BatchNorm2d(c), nn.Linear(c, classes)]
    return nn.ModuleList(mods)


def resnet20_cifar():
    mods, c = [nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)], 16
    for w in (16, 32, 64):
        for _ in range(3):
            mods += [nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                     nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w)]
            if c != w:
                mods += [nn.Conv2d(c, w, 1, bias=False), nn.BatchNorm2d(w)]
            c = w
    mods.append(nn.Linear(64, 10))
    return nn.ModuleList(mods)


class TinyTransformer(nn.Module):
    def __init__(self, vocab=256, t=32, d=64, heads=4, layers=2, classes=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(t, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, activation="gelu",
                                           norm_first=True, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d),
                                         enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)


def _conv_bn_relu6(c, out, k=3, stride=1, groups=1):
    return [nn.Conv2d(c, out, k, stride, (k - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out), nn.ReLU6()]


class InvertedResidual(nn.Module):  # torchvision.models.mobilenetv2.InvertedResidual
    def __init__(self, c, out, stride, t):
        super().__init__()
        hidden = c * t
        layers = _conv_bn_relu6(c, hidden, 1) if t != 1 else []
        layers += _conv_bn_relu6(hidden, hidden, 3, stride, hidden)
        layers += [nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out)]
        self.conv = nn.Sequential(*layers)
        self.res = stride == 1 and c == out

    def forward(self, x):
        return x + self.conv(x) if self.res else self.conv(x)


def mobilenet_v2():
    layers, c = _conv_bn_relu6(3, 32, 3, 2), 32
    for t, out, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                         (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
        for i in range(n):
            layers.append(InvertedResidual(c, out, s if i == 0 else 1, t))
            c = out
    layers += _conv_bn_relu6(c, 1280, 1)
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                         nn.Linear(1280, 1000))


class Fire(nn.Module):  # torchvision.models.squeezenet.Fire
    def __init__(self, c, squeeze, expand):
        super().__init__()
        self.squeeze = nn.Conv2d(c, squeeze, 1)
        self.e1 = nn.Conv2d(squeeze, expand, 1)
        self.e3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x):
        s = torch.relu(self.squeeze(x))
        return torch.cat([torch.relu(self.e1(s)), torch.relu(self.e3(s))], 1)


def squeezenet1_1():
    pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, stride=2), nn.ReLU(), pool(), Fire(64, 16, 64), Fire(128, 16, 64),
        pool(), Fire(128, 32, 128), Fire(256, 32, 128), pool(), Fire(256, 48, 192),
        Fire(384, 48, 192), Fire(384, 64, 256), Fire(512, 64, 256),
        nn.Dropout(0.5), nn.Conv2d(512, 1000, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten())


def _double_conv(c, w):
    return nn.Sequential(nn.Conv2d(c, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                         nn.ReLU(), nn.Conv2d(w, w, 3, padding=1, bias=False),
                         nn.BatchNorm2d(w), nn.ReLU())


class UNetSmall(nn.Module):
    def __init__(self, c=1, classes=2, width=16, depth=3):
        super().__init__()
        ws = [width * 2 ** i for i in range(depth + 1)]
        self.inc = _double_conv(c, width)
        self.down = nn.ModuleList(_double_conv(ws[i], ws[i + 1]) for i in range(depth))
        self.up = nn.ModuleList(nn.ConvTranspose2d(ws[i + 1], ws[i], 2, 2)
                                for i in reversed(range(depth)))
        self.upc = nn.ModuleList(_double_conv(2 * ws[i], ws[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(width, classes, 1)
        self.pools = nn.ModuleList(nn.MaxPool2d(2) for _ in range(depth))

    def forward(self, x):
        h = self.inc(x)
        skips = [h]
        for d, pool in zip(self.down, self.pools):
            h = d(pool(h))
            skips.append(h)
        for k, (u, c) in enumerate(zip(self.up, self.upc)):
            h = c(torch.cat([skips[-2 - k], u(h)], 1))
        return self.out(h)


class GptTiny(nn.Module):
    def __init__(self, vocab=64, t=32, d=64, heads=4, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(t, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, activation="gelu",
                                           norm_first=True, batch_first=True)
        self.dec = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d),
                                         enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)


CASES = [
    ("vgg16.net", vgg16),
    ("densenet121.net", densenet121),
    ("resnet50.net", lambda: bottleneck_resnet((3, 4, 6, 3))),
    ("resnet152.net", lambda: bottleneck_resnet((3, 8, 36, 3))),
    ("resnet164-cifar.net", lambda: preact_cifar(18)),
    ("resnet20-cifar.net", resnet20_cifar),
    ("transformer-tiny.net", TinyTransformer),
    ("mobilenet_v2.net", mobilenet_v2),
    ("squeezenet1_1.net", squeezenet1_1),
    ("unet-small.net", UNetSmall),
    ("gpt-tiny.net", GptTiny),
    ("gpt-100m.net", lambda: GptTiny(vocab=8192, t=64, d=768, heads=12, layers=12)),
    ("gpt-1b.net", lambda: GptTiny(vocab=8192, t=1024, d=2048, heads=16, layers=20)),
]


@pytest.mark.parametrize("example,build", CASES, ids=[c[0] for c in CASES])
def test_same_count_as_torch(example, build):
    with torch.device("meta"):
        m = build()
    assert n_params(load(example).graph) == count(m)


@pytest.mark.parametrize("example,build", [
    ("mobilenet_v2.net", mobilenet_v2), ("squeezenet1_1.net", squeezenet1_1),
    ("unet-small.net", UNetSmall)], ids=lambda c: c if isinstance(c, str) else "")
def test_same_shapes_as_torch(example, build):
    """Every op's output shape agrees with torch's on the meta device (ceil_mode pooling,
    strided depthwise convolutions, transposed convolutions)."""
    with torch.device("meta"):
        m = build()
        g = load(example).graph
        x = torch.empty((2,) + tuple(g["x"].type.shape[1:]))
        shapes = [tuple(y.shape[1:]) for y in _trace(m, x)]
    ours = [tuple(n.type.shape[1:]) for n in g.nodes if n.op in
            ("conv2d", "conv_transpose2d", "maxpool")]
    assert ours == shapes


def _trace(m, x):
    """Outputs of every Conv2d, ConvTranspose2d and MaxPool2d module, in call order."""
    seen = []
    kinds = (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d)
    hooks = [mod.register_forward_hook(lambda _m, _i, o: seen.append(o))
             for mod in m.modules() if isinstance(mod, kinds)]
    try:
        m(x)
    finally:
        for h in hooks:
            h.remove()
    return seen
