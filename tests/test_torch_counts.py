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


CASES = [
    ("vgg16.net", vgg16),
    ("densenet121.net", densenet121),
    ("resnet50.net", lambda: bottleneck_resnet((3, 4, 6, 3))),
    ("resnet152.net", lambda: bottleneck_resnet((3, 8, 36, 3))),
    ("resnet164-cifar.net", lambda: preact_cifar(18)),
    ("resnet20-cifar.net", resnet20_cifar),
    ("transformer-tiny.net", TinyTransformer),
]


@pytest.mark.parametrize("example,build", CASES, ids=[c[0] for c in CASES])
def test_same_count_as_torch(example, build):
    with torch.device("meta"):
        m = build()
    assert n_params(load(example).graph) == count(m)
