"""A small CNN (four conv layers, one residual add) for fast tests of the whole pipeline.

It has the layer kinds the pipeline must handle in ResNet-18 (conv + BatchNorm + ReLU, a strided
stage, a residual add, global pooling, a linear classifier) at a fraction of the cost.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """Four 3x3 convolutions (widths 32, 64, 64, 64) and a linear head."""

    def __init__(self, num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.stem = _conv_bn(3, width // 2, 1)
        self.down = _conv_bn(width // 2, width, 2)
        self.block_a = _conv_bn(width, width, 1)
        self.block_b = nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        )
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(self.stem(x))
        x = self.relu(self.block_b(self.block_a(x)) + x)
        return self.fc(torch.flatten(self.pool(x), 1))
