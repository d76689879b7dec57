"""Small PyTorch modules that several host-side tests share (they need torch: importorskip it
before importing this module)."""

from __future__ import annotations

from torch import nn


class Branchy(nn.Module):
    """A model that branches on its input's values, which tracing cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x).mean(dim=(2, 3))
        if x.mean() > 0:  # a branch on the data: tracing keeps the example's
            return y
        return -y
