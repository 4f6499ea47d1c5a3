"""What the engine's dispatcher needs from a task's runner: the :class:`Runner` protocol.

The dispatcher (``Engine``: filling devices, building candidates, advancing tasks, the
kept-graph reservations and the remaining-work estimates) reads a task only through
these members, so anything that implements them can be multiplexed:
:class:`~tune_hydra.engine.runtime.loop.LoopRunner` runs the ops a ``th.shard`` loop (a
user's, or a ``TaskLoop``'s) issues from its thread;
:class:`~tune_hydra.engine.dispatch.scripted.ScriptedRunner` plays ops written as strings,
for tests of the dispatcher's decisions. Register a runner with
``Engine.add_runner(name, runner)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from tune_hydra.core.ops import Op
    from tune_hydra.engine.registration.partition import ShardPlan
    from tune_hydra.engine.storage import ShardStore, Store
    from tune_hydra.engine.task import OwnedTensors

# The members the engine reads or calls on every registered runner (checked by
# Engine.add_runner, so that a wrong object fails there, not in the dispatcher thread).
RUNNER_MEMBERS = (
    "current",
    "granted",
    "iteration",
    "device_time",
    "on_iteration",
    "history",
    "plan",
    "stores",
    "ops_per_batch",
    "batches_done",
    "grant",
    "revoke",
    "stop",
    "advance",
    "execute",
    "store_of",
    "next_shard",
    "ops_until",
    "drop_batch",
    "owned_tensors",
)


class Runner(Protocol):
    """One task's operations, as the engine's dispatcher drives them.

    The engine calls every member under its lock, except :meth:`execute` (on a device
    worker's run thread, with the op's shard state resident on ``device``).

    Attributes:
        current: the task's ready op (the one it runs next), or ``None`` while it waits
            for a grant (or failed: :meth:`stop`). Changes only in :meth:`advance`,
            :meth:`stop` and a grant that wakes a waiting task.
        granted: iterations granted and not finished yet (``Engine.get_state`` needs 0).
        iteration: iterations finished (``Engine.summary``).
        device_time: seconds spent computing its ops (``Engine.summary``).
        on_iteration: set by the engine; the runner calls it with each finished
            iteration's result dict (``"batches"``: train batches it ran, ``"iteration"``:
            its number from 1, and whatever else the task reports).
        history: the results of its finished iterations, in order (what
            ``train_models`` returns).
        plan: the shard sizes device budgets count (``ShardSpec.state_bytes`` and
            ``activation_bytes`` per shard; the kept-graph reservations read them).
        stores: every shard store of the task, each once (registered with the host
            memory manager; offloaded when the task leaves).
        ops_per_batch: ops of one training batch (the remaining-work estimate).
        batches_done: train batches of the current iteration already run (subtracted
            from the remaining-work estimate).

    Optional: ``keeps_batch`` (a bool property, ``False`` when absent): the runner's batch
    keeps graphs on its device while no op is ready (a user-driven loop between its
    user's calls), so the engine holds the batch's kept-graph reservation
    (``tune_hydra.engine.runtime.kept``).
    """

    current: Op | None
    on_iteration: Callable[[dict[str, Any]], None] | None
    history: list[dict[str, Any]]

    @property
    def granted(self) -> int: ...

    @property
    def iteration(self) -> int: ...

    @property
    def device_time(self) -> float: ...

    @property
    def plan(self) -> ShardPlan: ...

    @property
    def stores(self) -> list[ShardStore]: ...

    @property
    def ops_per_batch(self) -> int: ...

    @property
    def batches_done(self) -> int: ...

    def grant(self, iterations: int) -> None:
        """Allow ``iterations`` more iterations (``Engine.train``)."""

    def revoke(self) -> None:
        """Take back the iterations not started (the task was cancelled)."""

    def stop(self) -> None:
        """The task failed: no next op, no iterations left."""

    def advance(self) -> Op | None:
        """Move :attr:`current` to the next op (after the current one completed, or a
        grant woke the task) and return it; raising fails the task."""

    def execute(self, op: Op, device: torch.device) -> None:
        """Run ``op`` (the :attr:`current` one) on ``device``; raising fails the task."""

    def store_of(self, shard: int) -> Store:
        """The store holding shard ``shard``'s state (what a device promotes for it)."""

    def next_shard(self, op: Op) -> int | None:
        """The shard the op after ``op`` most likely uses (prefetched while ``op`` runs);
        ``None``: ``op``'s own, or unknown (nothing is prefetched)."""

    def ops_until(self, op: Op | None, shard: int) -> int:
        """How many ops from ``op`` until one visits ``shard`` (disk read-ahead order)."""

    def drop_batch(self) -> None:
        """Let go of the batch in progress (the task failed or was cancelled)."""

    def owned_tensors(self) -> OwnedTensors:
        """The tensors the task trains (another task sharing them is refused)."""


def check_runner(name: str, runner: object) -> None:
    """Refuse an object that lacks a :class:`Runner` member, naming the missing ones.

    Raises:
        InvalidTaskError: naming what is missing and what to pass instead.
    """
    from tune_hydra.exceptions import InvalidTaskError

    missing = [m for m in RUNNER_MEMBERS if not hasattr(runner, m)]
    if missing:
        raise InvalidTaskError(
            f"runner {name!r} ({type(runner).__name__}) is not a tune_hydra Runner: it has "
            f"no {', '.join(missing)}; pass an object implementing "
            f"tune_hydra.engine.protocol.Runner (such as a ScriptedRunner), or train a "
            f"ModelTask as a TaskLoop"
        )


__all__ = ["RUNNER_MEMBERS", "Runner", "check_runner"]
