"""The benchmark table's networks written for PyTorch, as a PyTorch user writes them.

Each matches an example under examples/ layer for layer (the parameter counts are checked
against netdsl's by bench_step.py) and trains with the file's optimizer:

  resnet164 / resnet1001  examples/resnet164-cifar.net, resnet1001-cifar.net (pre-activation
                          bottleneck, 18 / 111 blocks per stage), SGD momentum 0.9, wd 1e-4
  resnet50                examples/resnet50.net (torchvision's resnet50, v1.5), SGD as above
  vgg16                   examples/vgg16.net (torchvision's vgg16), SGD lr 0.01, wd 5e-4
  digits-cnn              examples/digits-cnn.net, Adam lr 3e-3
  transformer-tiny        examples/transformer-tiny.net (pre-LN, fused q/k/v projection,
                          exact GELU), AdamW lr 1e-3, wd 0.01
  mobilenet_v2            examples/mobilenet_v2.net (torchvision's mobilenet_v2, width 1.0:
                          depthwise 3x3s, ReLU6), SGD lr 0.05, wd 4e-5
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class PreactBottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        out = 4 * width
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.proj = (nn.Conv2d(cin, out, 1, stride=stride, bias=False)
                     if stride != 1 or cin != out else None)

    def forward(self, x):
        a = torch.relu(self.bn1(x))
        h = self.conv1(a)
        h = self.conv2(torch.relu(self.bn2(h)))
        h = self.conv3(torch.relu(self.bn3(h)))
        return h + (x if self.proj is None else self.proj(a))


class PreactResNet(nn.Module):
    """CIFAR pre-activation bottleneck ResNet: 9 * blocks + 2 layers (18: 164, 111: 1001)."""

    def __init__(self, blocks: int, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        layers, cin = [], 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            for b in range(blocks):
                layers.append(PreactBottleneck(cin, width, stride if b == 0 else 1))
                cin = 4 * width
        self.stages = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.stages(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class Bottleneck(nn.Module):
    """torchvision's v1.5 bottleneck: the stride on the 3x3 convolution."""

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        out = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.down = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                   nn.BatchNorm2d(out))
                     if stride != 1 or cin != out else None)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return torch.relu(h + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for b in range(blocks):
                layers.append(Bottleneck(cin, width, stride if b == 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        h = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        h = self.layers(h)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class VGG16(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        layers, cin = [], 3
        for width, depth in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
            for _ in range(depth):
                layers += [nn.Conv2d(cin, width, 3, padding=1), nn.ReLU(inplace=True)]
                cin = width
            layers.append(nn.MaxPool2d(2, 2))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(0.5),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(0.5), nn.Linear(4096, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def _conv_bn(cin: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1):
    return nn.Sequential(nn.Conv2d(cin, out, kernel, stride, (kernel - 1) // 2, groups=groups,
                                   bias=False), nn.BatchNorm2d(out), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, out: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = [] if expand == 1 else [_conv_bn(cin, hidden, 1)]
        layers += [_conv_bn(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == out

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        layers, cin = [_conv_bn(3, 32, stride=2)], 32
        for out, blocks, stride, expand in ((16, 1, 1, 1), (24, 2, 2, 6), (32, 3, 2, 6),
                                            (64, 4, 2, 6), (96, 3, 1, 6), (160, 3, 2, 6),
                                            (320, 1, 1, 6)):
            for b in range(blocks):
                layers.append(InvertedResidual(cin, out, stride if b == 0 else 1, expand))
                cin = out
        layers.append(_conv_bn(cin, 1280, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = F.max_pool2d(torch.relu(self.bn2(self.conv2(h))), 2)
        return self.fc(torch.flatten(h, 1))


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ratio: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ratio * d), nn.Linear(ratio * d, d)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = (z.reshape(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).chunk(3, dim=2))
        a = F.scaled_dot_product_attention(q, k, v)
        h = x + self.out(a.transpose(1, 2).reshape(n, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class TransformerTiny(nn.Module):
    def __init__(self, vocab: int = 256, length: int = 32, d: int = 64, layers: int = 2,
                 heads: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(length, d) * 0.02)
        self.layers = nn.Sequential(*(EncoderLayer(d, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, classes)

    def forward(self, tokens):
        h = self.ln(self.layers(self.embed(tokens) + self.pos))
        return self.fc(h.mean(dim=1))


def _sgd(lr, wd):
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=wd)


def _image(shape, classes):
    def make(batch):
        return torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    return make


def _tokens(batch):
    return torch.randint(0, 256, (batch, 32)), torch.randint(0, 10, (batch,))


# name -> (model factory, optimizer factory, batch -> (input, labels))
NETWORKS = {
    "resnet164": (lambda: PreactResNet(18), _sgd(0.1, 1e-4), _image((3, 32, 32), 10)),
    "resnet1001": (lambda: PreactResNet(111), _sgd(0.1, 1e-4), _image((3, 32, 32), 10)),
    "resnet50": (ResNet50, _sgd(0.1, 1e-4), _image((3, 224, 224), 1000)),
    "vgg16": (VGG16, _sgd(0.01, 5e-4), _image((3, 224, 224), 1000)),
    "digits-cnn": (DigitsCNN, lambda ps: torch.optim.Adam(ps, lr=3e-3),
                   _image((1, 8, 8), 10)),
    "transformer-tiny": (TransformerTiny,
                         lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
                         _tokens),
    "mobilenet_v2": (MobileNetV2, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                              weight_decay=4e-5),
                     _image((3, 224, 224), 1000)),
}
