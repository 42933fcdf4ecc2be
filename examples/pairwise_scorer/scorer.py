"""A Crowd-BT-style image-pair quality scorer, written as a user writes one: a conv net gives each image a score, and
a Bradley-Terry loss learns from pairwise judgements ("the first image is better") made by a noisy crowd.

The images are generated (no download): a smooth pattern with noise of a random strength; the better image of a pair
is the less noisy one, and each judgement is wrong with probability `annotator_error`, as crowd workers are.
distsetup's run config names the three functions below: model.builder, data.builder and training.loss.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


class ConvBlock(nn.Module):
    """3x3 convolution, group norm and GELU, added to its input: the block FSDP2 shards and checkpointing recomputes."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)  # the norm would cancel a bias
        self.norm = nn.GroupNorm(8 if channels % 8 == 0 else 1, channels)  # per sample: no statistics across a batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.norm(self.conv(x)))


class Scorer(nn.Module):
    """Image [B, 3, H, W] -> quality score [B]."""

    def __init__(self, channels: int, depth: int):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, 1, bias=False)  # a Bradley-Terry loss sees only differences of scores

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3))).squeeze(-1)


def build_model(channels: int = 64, depth: int = 8) -> Scorer:
    return Scorer(channels, depth)


class ImagePairs(Dataset):
    """Pairs of generated images and the crowd's judgement of which is better; sample i is the same every time it is
    read (its own random generator), in any worker process."""

    def __init__(self, pairs: int, image_size: int, annotator_error: float, seed: int):
        self.pairs, self.size, self.error, self.seed = pairs, image_size, annotator_error, seed

    def __len__(self) -> int:
        return self.pairs

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        noise = torch.rand(2, generator=g)
        first, second = (self._image(level.item(), g) for level in noise)
        first_better = noise[0] < noise[1]
        if torch.rand(1, generator=g).item() < self.error:  # the annotator got it wrong
            first_better = ~first_better
        return {"first": first, "second": second, "first_better": first_better.float()}

    def _image(self, noise: float, g: torch.Generator) -> torch.Tensor:
        """A grating of random frequency and orientation in each channel, plus Gaussian noise of strength `noise`."""
        axis = torch.linspace(0, 1, self.size)
        y, x = torch.meshgrid(axis, axis, indexing="ij")
        angle, frequency, phase = torch.rand(3, 3, generator=g)
        pattern = torch.stack(
            [
                torch.sin(2 * math.pi * (1 + 4 * f) * (x * torch.cos(math.pi * a) + y * torch.sin(math.pi * a)) + 6 * p)
                for a, f, p in zip(angle, frequency, phase, strict=True)
            ]
        )
        return pattern + noise * torch.randn(3, self.size, self.size, generator=g)


def build_dataset(split: str, pairs: int = 4096, image_size: int = 32, annotator_error: float = 0.1):
    """The training pairs, or a held-out eighth as many for "val" (other images: another seed)."""
    if split == "train":
        return ImagePairs(pairs, image_size, annotator_error, seed=1)
    return ImagePairs(max(pairs // 8, 1), image_size, annotator_error, seed=2)


def pairwise_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bradley-Terry: P(first better) = sigmoid(score(first) - score(second)); the mean negative log-likelihood of the
    crowd's judgements, and beside it (logged, and evaluated on the validation split as val_accuracy) how often the
    scores order a pair as the crowd did. Both images of every pair go through the model in one forward."""
    scores = model(torch.cat([batch["first"], batch["second"]]))
    first, second = scores.chunk(2)
    agreed = ((first > second).float() == batch["first_better"]).float()
    return {
        "loss": F.binary_cross_entropy_with_logits(first - second, batch["first_better"]),
        "accuracy": agreed.mean(),
    }
