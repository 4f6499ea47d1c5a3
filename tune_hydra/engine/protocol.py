"""What the engine's dispatcher needs from a task's runner: the :class:`Runner` protocol.

The dispatcher offers each task's ready op (:attr:`Runner.current`) with what it costs
(its shard's store and sizes, how far off each shard's next op is), runs the one the
policy picks (:meth:`Runner.execute`) and tells the runner it is done
(:meth:`Runner.advance`). Grants, iteration counts, results and device time are the
engine's own (``engine/records.py``), so anything that implements these members can be
multiplexed: :class:`~tune_hydra.engine.runtime.loop.LoopRunner` runs the ops a
``th.shard`` loop (a user's, or a ``TaskLoop``'s) issues from its thread;
:class:`~tune_hydra.engine.dispatch.scripted.ScriptedRunner` plays ops written as strings,
for tests of the dispatcher's decisions. Register a runner with
``Engine.add_runner(name, runner)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

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
    "plan",
    "order",
    "store_of",
    "advance",
    "execute",
    "stop",
    "owned_tensors",
)


class OpOrder(Protocol):
    """The order of a task's ops, as far as the engine looks ahead (prefetch, the disk
    tier's outlook, remaining-work estimates): ``core.program.Program`` for a scripted
    task, ``OpPattern`` (learnt as the ops run) for a loop."""

    @property
    def ops_per_batch(self) -> int:
        """Ops of one training batch."""

    def next_shard(self, op: Op) -> int | None:
        """The shard the op after ``op`` most likely uses (prefetched while ``op`` runs);
        ``None``: ``op``'s own, or unknown (nothing is prefetched)."""

    def ops_until(self, op: Op | None, shard: int) -> int:
        """How many ops from ``op`` until one visits ``shard`` (disk read-ahead order)."""


class Runner(Protocol):
    """One task's operations, as the engine's dispatcher drives them.

    The engine calls every member under its lock, except :meth:`execute` (on a device
    worker's run thread, with the op's shard state resident on ``device``). An iteration
    is the ops from one :meth:`advance` that starts it to the one that returns ``None``;
    the engine starts one only while the task has iterations granted.

    Attributes:
        current: the task's ready op (the one it runs next), or ``None`` between its
            iterations (or failed: :meth:`stop`). Changes only in :meth:`advance` and
            :meth:`stop`.
        plan: the shard sizes device budgets count (``ShardSpec.state_bytes`` and
            ``activation_bytes`` per shard; the kept-graph reservations read them).
        order: its ops' order (:class:`OpOrder`).

    Optional: ``keeps_batch`` (a bool property, ``False`` when absent): the runner's batch
    keeps graphs on its device while no op is ready (a user-driven loop between its
    user's calls), so the engine holds the batch's kept-graph reservation
    (``tune_hydra.engine.runtime.kept``).
    """

    current: Op | None

    @property
    def plan(self) -> ShardPlan: ...

    @property
    def order(self) -> OpOrder: ...

    def store_of(self, shard: int) -> Store:
        """The store holding shard ``shard``'s state (what a device promotes for it)."""

    def advance(self) -> Op | None:
        """Move :attr:`current` on and return it: after the current op completed, its
        iteration's next op, or ``None`` (the iteration ended); between iterations (a
        grant), the next iteration's first op, or ``None`` (nothing to run yet). Raising
        fails the task."""

    def execute(self, op: Op, device: torch.device) -> None:
        """Run ``op`` (the :attr:`current` one) on ``device``; raising fails the task."""

    def stop(self) -> None:
        """The task failed, was cancelled or leaves: no next op, and the batch in
        progress (its kept graphs) is let go."""

    def owned_tensors(self) -> OwnedTensors:
        """The tensors the task trains (another task sharing them is refused)."""


def stores_of(runner: Runner) -> list[ShardStore]:
    """Every shard store of ``runner``'s task, each once (a store shared by two of its
    shards, or a part linked into several, counted once): what the host memory manager
    registers and what leaves with the task."""
    out: dict[int, ShardStore] = {}
    for i in range(len(runner.plan.shards)):
        for part in runner.store_of(i).parts():
            out[id(part)] = part
    return list(out.values())


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


__all__ = ["RUNNER_MEMBERS", "OpOrder", "Runner", "check_runner", "stores_of"]
