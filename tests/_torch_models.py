"""torchvision-style ResNet-18, MobileNetV2 and SqueezeNet 1.1, written out here so the
ONNX import tests need no torchvision and no downloads (same layers, same parameter
counts: 11,689,512, 3,504,872 and 1,235,496 for 1,000 classes)."""
from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, inp, out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inp, layers = 64, []
        for out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(inp, out, stride), BasicBlock(out, out)))
            inp = out
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _divisible(v, divisor=8):
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class ConvBNReLU6(nn.Sequential):
    def __init__(self, inp, out, kernel=3, stride=1, groups=1):
        super().__init__(nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups,
                                   bias=False),
                         nn.BatchNorm2d(out), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, inp, out, stride, expand):
        super().__init__()
        hidden = int(round(inp * expand))
        self.use_res = stride == 1 and inp == out
        layers = [ConvBNReLU6(inp, hidden, kernel=1)] if expand != 1 else []
        layers += [ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, out, 1, 1, 0, bias=False), nn.BatchNorm2d(out)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        inp, last = _divisible(32), _divisible(1280)
        features = [ConvBNReLU6(3, inp, stride=2)]
        for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                           (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
            out = _divisible(c)
            for i in range(n):
                features.append(InvertedResidual(inp, out, s if i == 0 else 1, t))
                inp = out
        features.append(ConvBNReLU6(inp, last, kernel=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class Fire(nn.Module):
    def __init__(self, inp, squeeze, e1, e3):
        super().__init__()
        self.squeeze = nn.Conv2d(inp, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, e1, 1)
        self.expand3x3 = nn.Conv2d(squeeze, e3, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.relu(self.squeeze(x))
        return torch.cat([self.relu(self.expand1x1(x)), self.relu(self.expand3x3(x))], 1)


class SqueezeNet11(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        pool = lambda: nn.MaxPool2d(3, 2, ceil_mode=True)  # noqa: E731
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2), nn.ReLU(inplace=True), pool(),
            Fire(64, 16, 64, 64), Fire(128, 16, 64, 64), pool(),
            Fire(128, 32, 128, 128), Fire(256, 32, 128, 128), pool(),
            Fire(256, 48, 192, 192), Fire(384, 48, 192, 192), Fire(384, 64, 256, 256),
            Fire(512, 64, 256, 256))
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(512, num_classes, 1),
                                        nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1)))

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


MODELS = {"resnet18": ResNet18, "mobilenet_v2": MobileNetV2, "squeezenet1_1": SqueezeNet11}
PARAMS = {"resnet18": 11_689_512, "mobilenet_v2": 3_504_872, "squeezenet1_1": 1_235_496}


def build(name: str, seed: int = 0) -> nn.Module:
    """The model in evaluation mode, with random batchnorm statistics and affine values
    (fresh ones are 0/1, which would hide a swapped mean and variance)."""
    torch.manual_seed(seed)
    m = MODELS[name]()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                c = mod.num_features
                mod.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(c, generator=g) + 0.5)
                mod.weight.copy_(torch.rand(c, generator=g) + 0.5)
                mod.bias.copy_(torch.randn(c, generator=g) * 0.1)
    return m.eval()


def export(model: nn.Module, path, size: int, fold_batchnorm: bool = False) -> None:
    """torch.onnx.export with the TorchScript exporter (the dynamo one needs onnxscript),
    a symbolic batch; batchnorm kept as its own node unless `fold_batchnorm`."""
    kw = {} if fold_batchnorm else {"training": torch.onnx.TrainingMode.PRESERVE}
    torch.onnx.export(model, torch.randn(1, 3, size, size), str(path), dynamo=False,
                      input_names=["image"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, **kw)
