"""A model larger than the memory the memory-cap test gives each build action: `layers` square float32 linear
layers of `width` (32 x 4096 x 4096: 2 GiB of weights, 64 MiB the largest tensor)."""

import torch
from torch import nn

from dsa.stages.spec import ExportSpec, InputSpec


class Stack(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def export_spec(view, dims):
    config = view["model"]["config"]
    width = config["width"]
    return ExportSpec(module=Stack(width, config["layers"]), inputs=[InputSpec("x", (1, width), "float32")],
                      outputs=["y"])
