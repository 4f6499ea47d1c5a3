"""The random numbers of a ``th.shard`` loop's ops: :class:`LoopRandom`.

An op draws from a generator of its own loop on the device's thread, never from torch's
global generator; which stream that is follows the user's thread (see "random numbers"
in :mod:`tune_hydra.engine.runtime.loop`). :class:`LoopRandom` holds the loop's own
stream, picks the generator each op draws from (:meth:`LoopRandom.choose`, on the user's
thread), installs it around a shard's compute (:meth:`LoopRandom.drawing`, on the
device's) and replays a forward's draws for its recompute (:meth:`LoopRandom.replay`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tune_hydra.engine.registration.factory import thread_generator, use_generator
from tune_hydra.engine.runtime import rng
from tune_hydra.engine.runtime.compiled import global_cpu_stream

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.loop import LoopShard


@dataclass
class Entry:
    """Where a forward's random numbers started: the CPU generator's state (``None``: it
    ran without one) and the GPU's (:func:`rng.task_stream`'s entry)."""

    cpu: torch.Tensor | None
    cuda: rng.RngState | None = None


class LoopRandom:
    """The random streams of one loop's ops.

    Args:
        rng_start: the state the loop's own CPU stream starts from.

    Attributes:
        op_gen: the CPU generator the op in flight draws from (chosen by the user's
            thread in :meth:`choose`, read by the device's).
        stream: the loop's stream on a GPU (its ``.cuda``).
    """

    def __init__(self, rng_start: torch.Tensor) -> None:
        # The loop's own CPU stream (see the loop module's docstring).
        self._gen = torch.Generator()
        self._gen.set_state(rng_start)
        self.op_gen = self._gen
        # Whether the op in flight draws from the main thread's stream (the global
        # generator's, handed to op_gen): then no other loop's draws can be in that
        # stream, and the op swaps it into the global generator (global_cpu_stream) instead
        # of running under the per-op dispatch mode of use_generator, which costs ~25% of
        # a CPU forward (every aten op through Python).
        self._op_main = False
        self._seed = torch.initial_seed()
        self.stream = rng.RngState(rng_start)
        self._compiled = False  # the loop's shards run torch.compile'd code on a CPU

    def state(self) -> torch.Tensor:
        """The loop's own CPU stream's state (a loop cut next goes on from it)."""
        return self._gen.get_state()

    def set_compiled(self, compiled: bool) -> None:
        """The loop's shards run compiled code from the next op on (``False``: eager
        again): compiled code draws from the global generator (see :meth:`global_stream`)."""
        self._compiled = compiled

    def choose(self) -> bool:
        """Pick the generator the next op draws from, on the user's thread: the thread's
        private one (:func:`~tune_hydra.engine.registration.factory.private_rng`), else the
        loop's own stream. Returns whether the thread is the main thread without a private
        one: its stream is torch's global generator, which the op's should follow."""
        gen = thread_generator()
        main = False
        if gen is None:
            gen = self._gen
            main = threading.current_thread() is threading.main_thread()
        self.op_gen = gen
        self._op_main = main
        return main

    def drawing(
        self, shard: LoopShard, device: torch.device, training: bool
    ) -> contextlib.AbstractContextManager[Entry | None]:
        """The op's random stream around a shard's compute in mode ``training`` (the
        generator :meth:`choose` chose, and the loop's stream of a GPU); nothing at all
        for a shard seen not to draw in this mode (``None`` then: nothing to replay)."""
        cpu = shard.draws.get(training) is not False
        if not cpu and device.type != "cuda":
            return contextlib.nullcontext()
        return self._installed(shard, device, training, cpu)

    def global_stream(self, device: torch.device) -> bool:
        """Whether the op's CPU draws go through torch's global generator (swapped in
        under ``CPU_RNG_LOCK``) rather than the dispatch mode: compiled code draws from
        the global generator, which no dispatch mode redirects (see
        ``tune_hydra.engine.runtime.compiled``); a main-thread loop's stream is the global one
        anyway, and its user's thread waits for the op."""
        return self._op_main or (self._compiled and device.type == "cpu")

    @contextlib.contextmanager
    def _installed(
        self, shard: LoopShard, device: torch.device, training: bool, cpu: bool
    ) -> Iterator[Entry]:
        gen = self.op_gen
        with contextlib.ExitStack() as stack:
            entry = Entry(gen.get_state() if cpu else None)
            mode: Any = None
            if cpu and self.global_stream(device):
                mode = stack.enter_context(global_cpu_stream(gen))
            elif cpu:
                mode = stack.enter_context(use_generator(gen))
            if device.type == "cuda":
                scope = stack.enter_context(
                    rng.task_stream(self.stream, device, self._seed, cpu=False)
                )
                entry.cuda = scope.entry
            yield entry
        if mode is not None and training not in shard.draws:
            shard.draws[training] = mode.drew

    @contextlib.contextmanager
    def replay(self, entry: Entry | None, device: torch.device) -> Iterator[None]:
        """A forward's random numbers again (its recompute), from the state it started
        from; the loop's streams do not advance."""
        with contextlib.ExitStack() as stack:
            if entry is not None and entry.cpu is not None:
                gen = torch.Generator()
                gen.set_state(entry.cpu)
                if self.global_stream(device):
                    stack.enter_context(global_cpu_stream(gen))  # as _installed
                else:
                    stack.enter_context(use_generator(gen))
            if entry is not None and entry.cuda is not None:
                stack.enter_context(
                    rng.task_stream(self.stream, device, self._seed, replay=entry.cuda, cpu=False)
                )
            yield


__all__ = ["Entry", "LoopRandom"]
