"""Where a task is in its data: the train and eval iterators, epochs, and resuming.

Batches are drawn on the task's CPU RNG stream (a shuffling ``DataLoader`` draws from
torch's global generator), so the data order is the one plain training sees. Each epoch
remembers the stream's state at its start: a task resumed mid-epoch replays that
epoch's order and skips the batches it already trained on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tune_hydra.engine.runtime import rng
from tune_hydra.engine.runtime.boundary import split_batch
from tune_hydra.engine.task import ModelTask
from tune_hydra.exceptions import ResumeStateError

_CPU = torch.device("cpu")
_END = object()  # what next() gives when the data ends


class DataCursor:
    """One task's position in its ``train_data`` and ``eval_data``.

    Args:
        name: the task's name, for the errors.
        task: the task whose data is iterated.
        seed: the task's seed (for the RNG stream's generators not seeded yet).
        stream: the task's RNG stream, advanced in place as batches are drawn.

    Attributes:
        epoch: epochs finished.
        batch_in_epoch: train batches of the current epoch trained on (the runner counts
            them as their backward completes).
    """

    def __init__(self, name: str, task: ModelTask, seed: int, stream: rng.RngState) -> None:
        self.name = name
        self._task = task
        self._seed = seed
        self._stream = stream
        self.epoch = 0
        self.batch_in_epoch = 0
        self._train_iter: Iterator[Any] | None = None
        self._eval_iter: Iterator[Any] | None = None
        self._exhausted = False
        # The stream's state when the epoch's iterator was made (what a resume replays).
        self._epoch_rng = rng.RngState(stream.cpu.clone())
        self._resume_epoch_rng = self._epoch_rng
        self._skip = 0  # batches to skip when the next epoch's iterator is made (resuming)

    @property
    def exhausted(self) -> bool:
        """Whether the last :meth:`fetch_train` found the epoch's data at its end."""
        return self._exhausted

    @property
    def eval_iter(self) -> Iterator[Any] | None:
        """The eval pass's iterator; ``None`` between eval passes."""
        return self._eval_iter

    def fetch_train(self, count: int) -> tuple[list[Any], list[Any]]:
        """Up to ``count`` train batches, as ``(inputs, targets)``: fewer at the end of
        the epoch, none (and :attr:`exhausted`) when it had no batch left."""
        inputs: list[Any] = []
        targets: list[Any] = []
        for _ in range(count):
            batch = self._next_train(first=not inputs)
            if batch is None:
                break
            inputs.append(batch[0])
            targets.append(batch[1])
        return inputs, targets

    def _next_train(self, first: bool) -> tuple[Any, Any] | None:
        if self._train_iter is None:
            self._epoch_rng = rng.RngState(self._stream.cpu.clone())
            if self._skip:  # resuming mid-epoch: replay the epoch's data order, then skip
                replay = self._resume_epoch_rng
                with rng.task_stream(self._stream, _CPU, self._seed, replay=replay):
                    self._train_iter = iter(self._task.train_data)
                    for done in range(self._skip):
                        if next(self._train_iter, _END) is _END:
                            raise ResumeStateError(
                                self.name,
                                f"the resume state's 'batch_in_epoch' is {self._skip}, but "
                                f"train_data yielded only {done} batch(es) this epoch: the "
                                f"state was saved with other data, or it is damaged or was "
                                f"tampered with. Restore it into a task with the data it "
                                f"was trained on, or start the trial afresh",
                            )
                self._epoch_rng, self._skip = self._resume_epoch_rng, 0
        with rng.task_stream(self._stream, _CPU, self._seed):
            if self._train_iter is None:
                self._train_iter = iter(self._task.train_data)
            try:
                batch = next(self._train_iter)
            except StopIteration:
                self._exhausted = first
                return None
        return split_batch(batch, self.name)

    def end_epoch(self) -> None:
        """Start the next epoch (a fresh train iterator on the next fetch)."""
        self._train_iter = None
        self._exhausted = False
        self.epoch += 1
        self.batch_in_epoch = 0

    def next_eval(self) -> tuple[Any, Any] | None:
        """The eval pass's next ``(inputs, targets)`` (the first one starts the pass);
        ``None`` once the pass is over."""
        assert self._task.eval_data is not None
        with rng.task_stream(self._stream, _CPU, self._seed):
            if self._eval_iter is None:
                self._eval_iter = iter(self._task.eval_data)
            try:
                batch = next(self._eval_iter)
            except StopIteration:
                self._eval_iter = None
                return None
        return split_batch(batch, self.name)

    def epoch_rng(self) -> torch.Tensor:
        """A copy of the CPU generator state the current epoch's data order was drawn
        from (for a resume state)."""
        return self._epoch_rng.cpu.clone()

    def resume_at(self, epoch: int, batch_in_epoch: int, epoch_rng: torch.Tensor) -> None:
        """Go on from batch ``batch_in_epoch`` of ``epoch``, whose data order was drawn
        from ``epoch_rng`` (a fresh cursor: nothing fetched yet).

        The epoch's order is replayed, and the batches before ``batch_in_epoch`` skipped,
        when its iterator is made on the next fetch.
        """
        self.epoch = epoch
        self.batch_in_epoch = batch_in_epoch
        self._skip = batch_in_epoch
        self._resume_epoch_rng = rng.RngState(epoch_rng.clone())
        # What a state taken before the next fetch must carry on (not the seed's).
        self._epoch_rng = self._resume_epoch_rng
