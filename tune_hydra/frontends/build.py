"""A trial, from what its task factory returned to a task its engine trains.

Every front end builds a trial in the same steps, and this module takes all but the
first:

1. call the user's factory in its own thread on a private random generator, waiting at
   most the factory timeout (:mod:`tune_hydra.engine.registration.factory`: ``call_factory`` blocks,
   ``start_factory`` gives a future for a front end that waits its own way);
2. :func:`check_task`: the factory returned a :class:`~tune_hydra.ModelTask`, else the
   error of :func:`~tune_hydra.frontends.failures.not_a_task`;
3. :meth:`TrialSet.add`: guard the model (modules another trial trained are refused,
   tensors that outlive the trial are trained as copies: :func:`~tune_hydra.frontends.
   trial.prepare_model`), add it to the engine under a free task name (a model type that
   cannot be cut fails that trial with :class:`~tune_hydra.exceptions.UncuttableModelError`),
   and record that the trial trains it (:data:`~tune_hydra.frontends.trial.CLAIMS`).

A :class:`TrialSet` is one front-end run's trials on one engine: the Ray engine actor has
one per engine, a ``th.optimize`` call one. It maps each trial's key (the Tune trial id,
Optuna's ``trial_<number>``) to its :class:`Trial` and its task name in the engine.

Importing this module imports neither torch nor Ray (the engine's modules load when a
trial is added).

Example:
    >>> import torch
    >>> from torch import nn
    >>> import tune_hydra as th
    >>> from tune_hydra.engine import Engine
    >>> def make_task():
    ...     model = nn.Sequential(nn.Linear(4, 1))
    ...     return th.ModelTask(model, nn.MSELoss(), lambda p: torch.optim.SGD(p, lr=0.1),
    ...                         [(torch.randn(2, 4), torch.randn(2, 1))])
    >>> with Engine("cpu") as engine:
    ...     trials = TrialSet(engine, {"seed": 0})
    ...     trial, shards = trials.add("a", check_task(make_task(), "a"))
    ...     again, _ = trials.add("a", make_task())  # a newer copy of trial "a"
    ...     trial.name, shards, again.name, engine.tasks()
    ('a', 1, 'a~1', ['a~1'])
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tune_hydra.exceptions import InvalidModelError
from tune_hydra.frontends.failures import not_a_task, uncuttable


def check_task(
    task: Any,
    trial: str,
    *,
    takes: str = "config",
    trainable: Callable[[], str | None] | None = None,
    systematic: bool = True,
) -> Any:
    """``task`` if it is a :class:`~tune_hydra.ModelTask`, else the error of
    :func:`~tune_hydra.frontends.failures.not_a_task` (``trainable()`` tells how a
    function trainable passed as the factory reports, if it was one; asked only then).

    Raises:
        NotATaskError: with ``systematic`` (every trial would repeat it).
        TaskFactoryError: without (that trial alone fails).
    """
    from tune_hydra.engine.task import ModelTask

    if isinstance(task, ModelTask):
        return task
    call = trainable() if trainable is not None else None
    raise not_a_task(trial, task, takes=takes, trainable=call or "", systematic=systematic)


@dataclass(eq=False)
class Trial:
    """A trial a :class:`TrialSet` trains.

    Attributes:
        key: the trial's key in its front end (a Tune trial id, ``trial_<number>``).
        name: its task's name in the engine.
        token: who owns it (the Tune proxy that registered it; ``""``: nobody in
            particular).
        config: its config (a checkpoint records its digest).
    """

    key: str
    name: str
    token: str = ""
    config: dict[str, Any] = field(default_factory=dict)


class TrialSet:
    """The trials one front-end run trains on one engine.

    Args:
        engine: the engine (``add_task``, ``remove_task``, ``cancel``, ``tasks``).
        task_options: ``Engine.add_task`` keywords every trial gets (``seed`` ...).
    """

    def __init__(self, engine: Any, task_options: Mapping[str, Any]) -> None:
        self.engine = engine
        self.task_options = dict(task_options)
        self._cv = threading.Condition()
        self._trials: dict[str, Trial] = {}
        self._adding: set[str] = set()  # keys being added (one add per key at a time)
        self._reserved: set[str] = set()  # task names being added
        self._count = 0

    def add(
        self, key: str, task: Any, *, token: str = "", config: Mapping[str, Any] | None = None
    ) -> tuple[Trial, int]:
        """Guard ``task``'s model, add it to the engine and record trial ``key``; returns
        the trial and its number of shards. A trial already under ``key`` (an older copy
        of it) is replaced: its task leaves the engine, and the new one gets a new name.
        Two adds of one key run one after the other, so the later one replaces the
        earlier.

        Raises:
            ReusedModelError, SharedModelError: another trial trained (or trains) the
                model's modules or tensors.
            UncuttableModelError: the model's type cannot be cut.
            TuneHydraError: what ``Engine.add_task`` raises (a layer over budget ...).
        """
        from tune_hydra.frontends.trial import CLAIMS, prepare_model

        with self._cv:
            while key in self._adding:
                self._cv.wait()
            self._adding.add(key)
        name = ""
        try:
            prepare_model(task.model, self, key, self.engine, TrialSet.trains)
            with self._cv:
                old = self._trials.pop(key, None)
                name = self._free_name(key, renamed=old is not None)
                self._reserved.add(name)
            if old is not None:
                self.engine.remove_task(old.name)
            try:
                shards = int(self.engine.add_task(name, task, **self.task_options))
            except InvalidModelError as err:
                raise uncuttable(key, task.model, err) from err
            trial = Trial(key, name, token, dict(config or {}))
            with self._cv:
                self._trials[key] = trial
            CLAIMS.record(task.model, self, key, self.engine, TrialSet.trains)
            return trial, shards
        finally:
            with self._cv:
                self._adding.discard(key)
                self._reserved.discard(name)
                self._cv.notify_all()

    def _free_name(self, key: str, renamed: bool) -> str:
        """``key``, or ``key~N`` when that name is taken (or the trial is replaced: a
        stale copy's calls must never reach the new task). Called with the lock held."""
        taken = set(self.engine.tasks()) | self._reserved
        name = key
        while renamed or name in taken:
            renamed = False
            self._count += 1
            name = f"{key}~{self._count}"
        return name

    def get(self, key: str) -> Trial | None:
        """The trial under ``key``, or None."""
        with self._cv:
            return self._trials.get(key)

    def keys(self) -> list[str]:
        """Every trial's key, sorted."""
        with self._cv:
            return sorted(self._trials)

    def trains(self, key: str) -> bool:
        """Whether trial ``key`` is in the set (it trains its model)."""
        with self._cv:
            return key in self._trials

    def cancel(self, key: str) -> None:
        """Drop the trial's queued work (it stays in the set); nothing if it is not here."""
        trial = self.get(key)
        if trial is not None:
            self.engine.cancel(trial.name)

    def remove(self, key: str, *, only: Trial | None = None) -> Trial | None:
        """Take trial ``key`` out of the set and its task out of the engine.

        Args:
            key: the trial.
            only: remove it only while it is this trial (not a newer copy).

        Returns:
            The trial removed, or None (not here, or not ``only``).
        """
        with self._cv:
            trial = self._trials.get(key)
            if trial is None or (only is not None and trial is not only):
                return None
            del self._trials[key]
        self.engine.remove_task(trial.name)
        return trial

    def clear(self) -> None:
        """Forget every trial (the engine is closing; its tasks go with it)."""
        with self._cv:
            self._trials.clear()


__all__ = ["Trial", "TrialSet", "check_task"]
