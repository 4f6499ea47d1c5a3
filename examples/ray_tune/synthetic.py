"""Offline stand-ins for the torchvision pieces Ray Tune's PyTorch examples use.

Ray's examples download MNIST / CIFAR-10 through ``torchvision``; here nothing is
downloaded and torchvision is not needed. ``from synthetic import datasets, transforms``
(or ``import synthetic as torchvision``) replaces the torchvision import, and the
examples' own data-loading code then runs as Ray wrote it:

* ``datasets.MNIST`` / ``datasets.CIFAR10`` / ``datasets.FakeData`` take torchvision's
  arguments (``root``, ``train``, ``download``, ``transform`` ...) and give datasets of
  the same length and item shapes (``(1, 28, 28)`` / ``(3, 32, 32)`` float images, an int
  label in 0..9). Each image is drawn from a generator seeded by its index, so a dataset
  holds no tensors (60,000 MNIST images cost no memory) and every process sees the same
  data; the label is a fixed random linear "teacher" of the image, so accuracy has
  something to learn (about 0.1 by chance).
* ``transforms.Compose`` / ``ToTensor`` / ``Normalize`` exist so the examples' transform
  pipelines build; the datasets yield tensors already and do not call them.

Example:
    >>> from synthetic import datasets
    >>> ds = datasets.MNIST("~/data", train=True, download=True)
    >>> len(ds), ds[3][0].shape, int(ds[3][1]) in range(10)
    (60000, torch.Size([1, 28, 28]), True)
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.utils.data import Dataset

_TEACHER_SEED = 1234


class _Synthetic(Dataset):
    """``size`` images of ``shape`` in [0, 1], labelled by a fixed random teacher."""

    def __init__(self, size: int, shape: tuple[int, ...], seed: int, classes: int = 10) -> None:
        self.size, self.shape, self.seed, self.classes = size, tuple(shape), seed, classes
        gen = torch.Generator().manual_seed(_TEACHER_SEED)
        numel = int(torch.Size(self.shape).numel())
        self.teacher = torch.randn(numel, classes, generator=gen)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(self.seed * 10_000_019 + index)
        image = torch.rand(self.shape, generator=gen)
        return image, int(((image.flatten() - 0.5) @ self.teacher).argmax())


def MNIST(root: str, train: bool = True, download: bool = False, transform: Any = None) -> Dataset:
    """MNIST's 60,000 / 10,000 items of shape ``(1, 28, 28)``."""
    return _Synthetic(60_000 if train else 10_000, (1, 28, 28), seed=1 if train else 2)


def CIFAR10(
    root: str, train: bool = True, download: bool = False, transform: Any = None
) -> Dataset:
    """CIFAR-10's 50,000 / 10,000 items of shape ``(3, 32, 32)``."""
    return _Synthetic(50_000 if train else 10_000, (3, 32, 32), seed=3 if train else 4)


def FakeData(
    size: int = 1000,
    image_size: tuple[int, ...] = (3, 224, 224),
    num_classes: int = 10,
    transform: Any = None,
    random_offset: int = 0,
) -> Dataset:
    """torchvision's ``FakeData``: ``size`` items of ``image_size``."""
    return _Synthetic(size, image_size, seed=5 + random_offset, classes=num_classes)


class _Transform:
    """A transform that builds and is never applied (the items are tensors already)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __call__(self, x: Any) -> Any:
        return x


datasets = types.SimpleNamespace(MNIST=MNIST, CIFAR10=CIFAR10, FakeData=FakeData)
transforms = types.SimpleNamespace(Compose=_Transform, ToTensor=_Transform, Normalize=_Transform)
