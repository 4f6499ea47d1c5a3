"""Fixtures the front-end tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def quiet_optuna() -> Iterator[None]:
    """Optuna's log at WARNING for the test (a study logs every trial at INFO)."""
    optuna = pytest.importorskip("optuna")
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(level)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test: the engine gives each emulated device
    a share of the threads, and a reduction split differently rounds differently."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def engine() -> Iterator[object]:
    """An engine on 2 emulated copying CPU devices, at most 2 layers a shard (th.shard's
    tests)."""
    import tune_hydra as th

    eng = th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2)
    yield eng
    eng.close()


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The syncs that brought a loop's state home during the test (``LoopRunner.sync``
    calls that found it away), one item each."""
    from tune_hydra.engine.runtime.loop import LoopRunner

    found: list[int] = []
    sync = LoopRunner.sync

    def counted(self: LoopRunner) -> None:
        if not self.at_home:
            found.append(1)
        sync(self)

    monkeypatch.setattr(LoopRunner, "sync", counted)
    return found
