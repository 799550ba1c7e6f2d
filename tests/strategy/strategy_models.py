"""Models the strategy tests plan and measure."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A residual MLP block: the repeated unit full sharding gathers one at a time."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))
