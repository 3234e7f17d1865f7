"""A small CIFAR-style ResNet (``resnet``).

A 3x3 stem, three stages of two basic blocks (conv-BN-ReLU-conv-BN plus shortcut; the first
block of stages 2 and 3 halves the resolution with a 1x1 strided projection shortcut), global
average pooling, a linear classifier and cross-entropy. BatchNorm in training mode updates its
running statistics, so the step mutates buffers as well as producing gradients.

Static: the whole step is a single Dynamo fragment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from memcompile.zoo import register
from memcompile.zoo.base import Workload, generator


@dataclass(frozen=True)
class _Config:
    widths: tuple[int, int, int]  # channels of the three stages
    image: int  # height = width
    batch: int
    classes: int = 10


_CONFIGS: dict[str, _Config] = {
    "tiny": _Config(widths=(8, 16, 32), image=16, batch=4),
    "small": _Config(widths=(16, 32, 64), image=32, batch=32),
    "bench": _Config(widths=(64, 128, 256), image=32, batch=32),
}


class BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """``forward(images, labels)`` returns the classification loss."""

    def __init__(self, widths: tuple[int, int, int], classes: int, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c_in = widths[0]
        for stage, c_out in enumerate(widths):
            for i in range(blocks):
                layers.append(BasicBlock(c_in, c_out, stride=2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(images))
        return F.cross_entropy(self.fc(x.mean(dim=(2, 3))), labels)


@register("resnet")
def build_resnet(size: str, seed: int) -> Workload:
    """Three stages of two basic blocks with BatchNorm on small RGB images."""
    cfg = _CONFIGS[size]
    widths, image, b, classes = cfg.widths, cfg.image, cfg.batch, cfg.classes
    torch.manual_seed(seed)
    model = ResNet(widths, classes)
    # Class prototypes make the labels learnable. Step -1 is no training step: the prototypes
    # are fixed by the seed and shared by every batch.
    protos = torch.randn(classes, 3, image, image, generator=generator(seed, -1))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed, step)
        labels = torch.randint(classes, (b,), generator=g)
        images = protos[labels] + torch.randn(b, 3, image, image, generator=g)
        return images, labels

    return Workload(
        name="resnet",
        summary=(
            f"ResNet, 3 stages x 2 basic blocks, widths {widths}, BatchNorm, "
            f"on (B {b}, 3x{image}x{image}) images, {classes} classes"
        ),
        model=model,
        batch_fn=batch,
        dynamic=False,
        single_fragment=True,
        extra=dict(asdict(cfg), blocks_per_stage=2, batchnorm=True),
    )
