"""The storage tier contract, run against every tier implementation (and the test tier)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.engine.storage.counting_tier import CountingTier
from tune_hydra.engine.storage import HostTier, PinnedHostTier, StorageTier

_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TIERS = [
    pytest.param(HostTier, id="host"),
    pytest.param(PinnedHostTier, id="pinned", marks=[pytest.mark.gpu, _NO_CUDA]),
    pytest.param(CountingTier, id="counting"),
]


def _value(shape: tuple[int, ...] = (3, 4), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=dtype).reshape(shape) + 0.5


@pytest.mark.parametrize("make", TIERS)
class TestStorageTier:
    def test_starts_empty(self, make: Callable[[], StorageTier]) -> None:
        tier = make()
        assert list(tier.keys()) == [] and tier.items() == []
        assert ("p", 0) not in tier and tier.nbytes() == 0
        with pytest.raises(KeyError):
            tier.get(("p", 0))

    def test_put_hands_out_a_host_buffer_get_returns_it(
        self, make: Callable[[], StorageTier]
    ) -> None:
        tier = make()
        value = _value()
        buf = tier.put(("p", 0), value)
        assert buf.device.type == "cpu" and buf.shape == value.shape
        assert buf.dtype == value.dtype and buf.is_pinned() is tier.pinned
        buf.copy_(value)
        tier.flush()
        assert ("p", 0) in tier and ("p", 1) not in tier
        assert tier.get(("p", 0)) is buf and torch.equal(buf, value)
        assert [k for k, _ in tier.items()] == [("p", 0)]
        assert tier.nbytes() == value.numel() * value.element_size()

    def test_buffers_are_allocated_once_and_reused(self, make: Callable[[], StorageTier]) -> None:
        tier = make()
        first = tier.put(("o", 0, "exp_avg"), _value())
        assert tier.put(("o", 0, "exp_avg"), _value()) is first
        other = tier.put(("g", 0), _value())
        assert other is not first
        assert tier.nbytes() == 2 * 12 * 8

    def test_a_new_shape_or_dtype_replaces_the_buffer(
        self, make: Callable[[], StorageTier]
    ) -> None:
        tier = make()
        first = tier.put(("b", 0), _value())
        wider = tier.put(("b", 0), _value((3, 5)))
        assert wider is not first and wider.shape == (3, 5)
        narrower = tier.put(("b", 0), _value((3, 5), torch.float32))
        assert narrower.dtype == torch.float32
        assert tier.nbytes() == 15 * 4  # the replaced buffers are not counted

    def test_keep_stores_the_value(self, make: Callable[[], StorageTier]) -> None:
        tier = make()
        value = _value()
        held = tier.keep(("p", 0), value)
        tier.flush()
        assert tier.get(("p", 0)) is held and torch.equal(held, value)
        assert held.device.type == "cpu" and held.is_pinned() is tier.pinned
        assert tier.nbytes() == value.numel() * value.element_size()


def test_host_tier_adopts_the_users_tensors() -> None:
    """No pinning: the model's own tensors are the host buffers, nothing is copied."""
    tier = HostTier()
    value = _value()
    assert tier.keep(("p", 0), value) is value


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only")
def test_pinned_tier_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="needs CUDA"):
        PinnedHostTier()
