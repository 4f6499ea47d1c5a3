"""Scripted tasks: drive the real engine's dispatcher with ops written as strings.

A :class:`ScriptedRunner` is a :class:`~tune_hydra.engine.protocol.Runner` whose ops come
from a string in the ops' own notation (:meth:`tune_hydra.core.ops.Op.parse`; the task
prefix may be left out), one iteration's worth, repeated for each granted iteration.
Its ops compute nothing: each has a scripted duration, and each shard a tiny store with
scripted sizes (the bytes device budgets count). :func:`play` runs scripted tasks on an
engine whose clock is a :class:`ManualClock`, one op completion at a time, in the order
of their scripted end times, so the dispatcher's decisions (which op each device runs,
when) are reproducible exactly: no sleeps, and no thread race decides anything.

Example:
    >>> from tune_hydra.engine import Engine
    >>> from tune_hydra.engine.dispatch.scripted import ManualClock, ScriptedRunner, play
    >>> with Engine(["cpu"], policy="lrtf", clock=ManualClock()) as engine:
    ...     _ = engine.add_runner("a", ScriptedRunner("a", "F0[0] L1[0] B0[0]"))
    ...     _ = engine.add_runner("b", ScriptedRunner("b", "L0[0]", durations=5.0))
    ...     played = play(engine, {"a": 1, "b": 1})
    >>> played.order  # LRTF: a's 3 ops first (before measuring, each op counts the same)
    'a:F0[0] a:L1[0] a:B0[0] b:L0[0]'
    >>> played.on("cpu"), played.makespan
    ('a:F0[0] a:L1[0] a:B0[0] b:L0[0]', 8.0)
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.core.ops import Op
from tune_hydra.core.program import Program
from tune_hydra.engine.registration.partition import ShardPlan, ShardSpec
from tune_hydra.engine.storage import ShardStore, Store
from tune_hydra.engine.task import OwnedTensors
from tune_hydra.exceptions import InvalidTaskError, ScheduleError

if TYPE_CHECKING:
    import concurrent.futures

    from tune_hydra.engine.engine import Engine


class ManualClock:
    """A clock that stands still until it is :meth:`set` (an ``Engine(clock=...)``)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    def set(self, now: float) -> None:
        """Move the clock to ``now`` (never back).

        Raises:
            ValueError: ``now`` is before the clock's time.
        """
        if now < self._now:
            raise ValueError(f"a clock does not go back: at {self._now}, asked for {now}")
        self._now = float(now)

    def __repr__(self) -> str:
        return f"ManualClock({self._now})"


class _Gate:
    """Holds each scripted op in :meth:`ScriptedRunner.execute` until :func:`play`
    releases it; ``version`` counts the events :func:`play` waits for (an op entered, a
    task advanced), so that no wake-up is missed."""

    def __init__(self, clock: Callable[[], float], timeout: float) -> None:
        self.clock = clock
        self.timeout = timeout
        self.cv = threading.Condition()
        self.version = 0
        self.entered: dict[Op, float] = {}
        self.released: set[Op] = set()
        self.open = False  # play() ended: nothing is held any more

    def enter(self, op: Op) -> None:
        with self.cv:
            self.entered[op] = self.clock()
            self.version += 1
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: self.open or op in self.released, self.timeout):
                raise ScheduleError(f"scripted op {op} was never released by play()")

    def changed(self) -> None:
        with self.cv:
            self.version += 1
            self.cv.notify_all()


def _holder() -> nn.Module:
    """A module whose one buffer stands for a shard's state (a few bytes: the budgets
    count the scripted sizes, not these)."""
    m = nn.Module()
    m.register_buffer("state", torch.zeros(1))
    return m


class ScriptedRunner:
    """A :class:`~tune_hydra.engine.protocol.Runner` that plays ops from a string.

    Args:
        name: the task's name (the engine's, and its ops').
        script: one iteration's ops, separated by spaces or commas, as
            ``Op.__str__`` prints them (``"a:F0[0] a:L1[0] a:B0[0]"``); the ``task:``
            prefix may be left out (``"F0[0] L1[0] B0[0]"``). Each iteration repeats
            them (with its own ``@iteration``). The shards are 0 .. the largest used.
        durations: seconds each op takes: one number for all, or a mapping whose keys
            are an op's kind and shard (``"F0"``), or its kind (``"F"``); ``"*"`` is the
            default (1.0 without it).
        state_bytes: bytes of each shard's state, one number for all or one per shard.
        activation_bytes: bytes an op of each shard needs beside its state.

    Raises:
        InvalidTaskError: an empty script, a word that is no op, an op of another task
            or with an ``@iteration``, an op twice, or sizes that do not match the shards.
    """

    def __init__(
        self,
        name: str,
        script: str,
        *,
        durations: float | Mapping[str, float] = 1.0,
        state_bytes: int | Sequence[int] = 64,
        activation_bytes: int | Sequence[int] = 0,
    ) -> None:
        self.name = name
        self._ops = _parse(name, script)
        n = 1 + max(op.shard for op in self._ops)
        states = _per_shard(name, "state_bytes", state_bytes, n)
        acts = _per_shard(name, "activation_bytes", activation_bytes, n)
        self._durations = durations
        for op in self._ops:
            self.duration(op)  # a bad duration fails here, not in a worker
        self._plan = ShardPlan(
            tuple(ShardSpec(i, i, i + 1, (f"s{i}",), states[i], acts[i]) for i in range(n)),
            budget=None,
            prefetch=False,
            layers=(),
        )
        self._stores = [
            ShardStore([_holder()], name=(name, i), footprint=(states[i], acts[i]))
            for i in range(n)
        ]
        self.order = _Order(name, n)
        self.current: Op | None = None
        self.iteration = 0  # iterations finished (its ops' @iteration)
        self.executed: list[Op] = []  # every op run, in order
        self._pos = 0  # next op of the iteration's script
        self._gate: _Gate | None = None

    def __repr__(self) -> str:
        return f"ScriptedRunner({self.name!r}, {' '.join(map(str, self._ops))!r})"

    def duration(self, op: Op) -> float:
        """The scripted seconds of ``op``."""
        d = self._durations
        if not isinstance(d, Mapping):
            seconds = d
        else:
            kind = op.kind.value
            seconds = d.get(f"{kind}{op.shard}", d.get(kind, d.get("*", 1.0)))
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
            raise InvalidTaskError(
                f"scripted task {self.name!r}: the duration of {op} must be seconds >= 0, "
                f"not {seconds!r}"
            )
        return float(seconds)

    # -- the Runner protocol -----------------------------------------------------------

    @property
    def plan(self) -> ShardPlan:
        return self._plan

    def store_of(self, shard: int) -> Store:
        return self._stores[shard]

    def stop(self) -> None:
        self.current = None

    def advance(self) -> Op | None:
        if self.current is not None and self._pos == len(self._ops):  # its iteration ended
            self.iteration += 1
            self._pos = 0
            self.current = None
        else:
            self.current = dataclasses.replace(self._ops[self._pos], iteration=self.iteration)
            self._pos += 1
        if self._gate is not None:
            self._gate.changed()
        return self.current

    def execute(self, op: Op, device: torch.device) -> None:
        self.executed.append(op)
        gate = self._gate
        if gate is not None:
            gate.enter(op)

    def owned_tensors(self) -> OwnedTensors:
        return OwnedTensors()


class _Order(Program):
    """A scripted task's op order: its batch cycle's, without speculative prefetch (a
    device copies only the ops assigned to it, so what is resident when the dispatcher
    decides does not depend on a copy thread's pace)."""

    def next_shard(self, op: Op) -> int | None:
        return None


@dataclass
class Played:
    """What :func:`play` saw: each op with its device and scripted start and end.

    Attributes:
        ops: ``(start, device label, op, end)`` in start order (ties: device order).
        results: each task's iteration results.
    """

    ops: list[tuple[float, str, Op, float]] = field(default_factory=list)
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def order(self) -> str:
        """Every op in the order it started, as a string (``"a:F0[0] b:F0[0] ..."``)."""
        return " ".join(str(op) for _, _, op, _ in self.ops)

    def on(self, device: str) -> str:
        """The ops device ``device`` (its label) ran, in order, as a string."""
        return " ".join(str(op) for _, label, op, _ in self.ops if label == device)

    @property
    def makespan(self) -> float:
        """The scripted time the last op ended."""
        return max((end for *_, end in self.ops), default=0.0)


def play(engine: Engine, grants: Mapping[str, int], *, timeout: float = 60.0) -> Played:
    """Train scripted tasks on ``engine`` until their grants are done, releasing one op
    at a time in the order of their scripted end times, and return what ran where.

    The engine's clock must be a :class:`ManualClock`, and every task in ``grants`` a
    :class:`ScriptedRunner` registered with ``engine.add_runner``. The grants are made
    together (:meth:`Engine.hold_dispatch`), so the first decision sees them all. Then,
    each time every device's queued ops are in place (the running ones started, the
    queued ones' states copied in): the running op that ends first (ties: the first
    device) completes at its end time, and the dispatcher decides what follows.

    Raises:
        InvalidTaskError: a task is not scripted, or the clock is not a ``ManualClock``.
        ScheduleError: nothing runs while a grant is not done (the dispatcher left every
            device idle), or an event did not come within ``timeout`` seconds.
    """
    clock = engine.clock
    if not isinstance(clock, ManualClock):
        raise InvalidTaskError(
            "play() needs an engine with a ManualClock: Engine(..., clock=ManualClock())"
        )
    runners: dict[str, ScriptedRunner] = {}
    for name in grants:
        runner = engine.runner(name)
        if not isinstance(runner, ScriptedRunner):
            raise InvalidTaskError(
                f"play(): task {name!r} is no ScriptedRunner ({type(runner).__name__}); "
                f"register scripted tasks with engine.add_runner(name, ScriptedRunner(...))"
            )
        runners[name] = runner
    gate = _Gate(clock, timeout)
    for runner in runners.values():
        runner._gate = gate
    labels = [w.label for w in engine.workers]
    played = Played()
    seen: set[Op] = set()
    try:
        with engine.hold_dispatch():
            futures = {name: engine.train(name, n) for name, n in grants.items()}
        while True:
            heads = _settled(engine, gate)
            for label, op in heads.items():
                if op not in seen:
                    seen.add(op)
                    start = gate.entered[op]
                    end = start + runners[op.task].duration(op)
                    played.ops.append((start, label, op, end))
            if not heads:
                break
            label, op = min(
                heads.items(),
                key=lambda kv: (
                    gate.entered[kv[1]] + runners[kv[1].task].duration(kv[1]),
                    labels.index(kv[0]),
                ),
            )
            clock.set(gate.entered[op] + runners[op.task].duration(op))
            _release(engine, gate, op)
        played.ops.sort(key=lambda x: (x[0], labels.index(x[1])))
        played.results = _results(futures)
    finally:
        with gate.cv:
            gate.open = True
            gate.cv.notify_all()
        for runner in runners.values():
            runner._gate = None
    return played


def _settled(engine: Engine, gate: _Gate) -> dict[str, Op]:
    """Wait until each device's running op has started (and its queued ones' states are
    copied in); return the running op of each busy device."""
    while True:
        with gate.cv:
            version = gate.version
        queued = engine.queued()
        heads = {label: ops[0] for label, ops in queued.items() if ops}
        if all(op in gate.entered for op in heads.values()):
            for w in engine.workers:
                for a in list(w.assigned)[1:]:
                    if a.ready is not None and not a.ready.wait(gate.timeout):
                        raise ScheduleError(f"the copy of {a.op}'s shard did not end")
            return heads
        what = ", ".join(map(str, heads.values()))
        _wait_change(gate, version, f"scripted ops {what} were queued but did not start")


def _release(engine: Engine, gate: _Gate, op: Op) -> None:
    """Let ``op`` end, and wait until the engine has taken it off its device (and made
    the decisions that follow, under its lock)."""
    with gate.cv:
        gate.released.add(op)
        gate.cv.notify_all()
    while True:
        with gate.cv:
            version = gate.version
        if not any(op in ops for ops in engine.queued().values()):
            return
        _wait_change(gate, version, f"scripted op {op} was released but did not end")


def _wait_change(gate: _Gate, version: int, what: str) -> None:
    """Wait for the gate's next event after ``version``."""
    with gate.cv:
        if not gate.cv.wait_for(lambda: gate.version != version, gate.timeout):
            raise ScheduleError(f"{what} within {gate.timeout} s")


def _results(
    futures: Mapping[str, concurrent.futures.Future[list[dict[str, Any]]]],
) -> dict[str, list[dict[str, Any]]]:
    pending = [name for name, f in futures.items() if not f.done()]
    if pending:
        raise ScheduleError(
            f"play(): no op runs, yet task(s) {', '.join(pending)} have iterations left: the "
            f"dispatcher left every device idle"
        )
    return {name: f.result() for name, f in futures.items()}


def _parse(name: str, script: str) -> list[Op]:
    ops = []
    for word in re.split(r"[\s,]+", script.strip()):
        if not word:
            continue
        text = word if re.match(r".*:[FLBSE]\d", word) else f"{name}:{word}"
        try:
            op = Op.parse(text)
        except ValueError as err:
            raise InvalidTaskError(f"scripted task {name!r}: {err}") from None
        if op.task != name or op.iteration:
            raise InvalidTaskError(
                f"scripted task {name!r}: {word!r} is not an op of this task's iteration "
                f"(write its ops as {name}:F0[0] or F0[0], without @iteration)"
            )
        if op in ops:
            raise InvalidTaskError(f"scripted task {name!r}: {op} is written twice")
        ops.append(op)
    if not ops:
        raise InvalidTaskError(f"scripted task {name!r}: the script has no op")
    return ops


def _per_shard(name: str, what: str, value: int | Sequence[int], n: int) -> list[int]:
    values = [value] * n if isinstance(value, int) else list(value)
    if len(values) != n or any(
        isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values
    ):
        raise InvalidTaskError(
            f"scripted task {name!r}: {what} must be an int >= 0 or one per shard ({n}), "
            f"not {value!r}"
        )
    return values


__all__ = ["ManualClock", "Played", "ScriptedRunner", "play"]
