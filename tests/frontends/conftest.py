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
