"""Models for the PyTorch examples and benchmarks, defined here so nothing
needs torchvision.

    small_cnn   3x32x32 -> 10, three conv layers and two linear ones (~160k parameters)
    mlp         3x32x32 -> 10, three linear layers (~1.7M parameters)
    resnet8     3x32x32 -> 10, a narrow ResNet with three stages (~78k parameters)
"""

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, in_channels=3, classes=10, width=32, image=32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        side = image // 8
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(4 * width * side * side, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class MLP(nn.Module):
    def __init__(self, in_features=3 * 32 * 32, hidden=512, classes=10):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNet8(nn.Module):
    def __init__(self, classes=10, width=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(_Block(width, width, 1), _Block(width, 2 * width, 2),
                                    _Block(2 * width, 4 * width, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(4 * width, classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


MODELS = {"small_cnn": SmallCNN, "mlp": MLP, "resnet8": ResNet8}


def build(name):
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return MODELS[name]()


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())
