"""The dispatcher: which task's ready op each device runs next, and what follows an op.

Design: :class:`~tune_hydra.engine.engine.Engine` is a facade over two owners, one job
each, under the engine's one lock (``Engine._cv``):

- :class:`TaskRegistry` (registration/registry.py) decides *which tasks exist*: it checks
  and admits them (names, models shared with another task, probing and planning a
  ``ModelTask``, a ``Runner`` of ``add_runner``), builds their runners and owns the
  ``name -> TaskRecord`` map.
- :class:`Dispatcher` (here) runs *the tasks' lives on the devices*: the grants and their
  futures, every dispatch decision (offer -> choose -> validate, ``core/dispatch.py``),
  the completion of each op (estimates, the next op, failures, cancellation), the
  kept-graph reservations' lifetime, the disk tier's outlook, and bringing a task's
  states home. It reads the registry's map and writes only the records' dispatch fields
  (``assigned``, ``candidate``, ``ready_since`` ...).

The registry never calls the dispatcher, and neither module imports the other; the few
operations that need both (``remove_task``, ``close``) are sequenced by
``Engine`` under the lock.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import logging
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tune_hydra.core.dispatch import decide, offer
from tune_hydra.core.ops import Op
from tune_hydra.core.policies import BasePolicy, Candidate
from tune_hydra.engine.dispatch.anticipate import Anticipation
from tune_hydra.engine.dispatch.workers import _POLL_S, Assignment, DeviceWorker
from tune_hydra.engine.protocol import stores_of
from tune_hydra.engine.records import PendingIterations, TaskRecord
from tune_hydra.engine.runtime.kept import KeptGraphs
from tune_hydra.engine.storage import Store
from tune_hydra.engine.storage.frozen import shared_on_device
from tune_hydra.engine.storage.host import HostMemory
from tune_hydra.exceptions import ScheduleError, TaskFailedError, TuneHydraError

if TYPE_CHECKING:
    from tune_hydra.engine.dispatch.batched import SharedBatcher

log = logging.getLogger(__name__)


class Dispatcher:
    """Multiplexes the registered tasks' ops onto the devices (see the module docstring).

    Args:
        tasks: the registry's ``name -> TaskRecord`` map (read here, never added to).
        cv: the engine's lock (re-entrant), which guards the map and the records.
        workers: the devices' workers.
        policy: the scheduling policy.
        host: the engine's host memory manager (busy marks, outlook, failures).
        kept: the kept-graph reservations (``recompute=False`` on devices that copy).
        clock: the engine's clock (readiness times).
    """

    def __init__(
        self,
        tasks: Mapping[str, TaskRecord],
        cv: threading.Condition,
        workers: Sequence[DeviceWorker],
        policy: BasePolicy,
        host: HostMemory,
        kept: KeptGraphs,
        clock: Callable[[], float],
        batcher: SharedBatcher | None = None,
    ) -> None:
        self._tasks = tasks
        # Engine(batch_shared=True): groups ops of one shared shard into one batched pass.
        self.batcher = batcher
        self._cv = cv
        self.workers = workers
        self.policy = policy
        self.host = host
        self._kept = kept
        self.clock = clock
        self._max_depth = max(w.depth for w in workers)
        self._op_sum = 0.0  # all measured op durations, for unmeasured tasks' estimates
        self._op_n = 0
        self._held = 0  # hold() depth: no decision while > 0
        self._waits = Anticipation()  # devices waiting for a loop about to come back
        self._closed = False
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="hydra-dispatch", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._closed

    # -- what the engine's public methods ask (all under the engine's lock) -----------------

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """``Engine.hold_dispatch``: no decision inside; one on leaving (outermost)."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                if not self._held and not self._closed and self._broken is None:
                    self._dispatch()
                self._cv.notify_all()

    def grant(
        self, entry: TaskRecord, iterations: int
    ) -> concurrent.futures.Future[list[dict[str, Any]]]:
        """Grant ``entry`` ``iterations`` more iterations; the future gets their results."""
        fut: concurrent.futures.Future[list[dict[str, Any]]] = concurrent.futures.Future()
        with self._cv:
            if self._broken is not None:
                fut.set_exception(self._broken)
                return fut
            if entry.error is not None or entry.cancelled:
                fut.set_exception(
                    # A copy: raising it adds the caller's frames to its traceback.
                    _frameless(entry.error)
                    if entry.error is not None
                    else TaskFailedError(entry.name, "it was cancelled; remove it")
                )
                return fut
            entry.pending.append(PendingIterations(fut, iterations))
            self._waits.came(entry, self.clock())
            entry.granted += iterations
            # The work announced (Engine.set_remaining) comes as grants: these are part
            # of it now. A loop is granted one op at a time, so without this its estimate
            # never went down between announcements and LRTF could not even the tasks'
            # ends (4 loops on 2 devices: one finished 0.28 s after the others, alone).
            entry.set_hint(entry.hint - iterations)
            entry.candidate = None  # more work left: a new estimate
            if entry.runner.current is None and entry.assigned is None:
                self._advance(entry)
            entry.ready_since = self.clock()
            self._cv.notify_all()
        return fut

    def cancel(self, entry: TaskRecord) -> None:
        """Drop ``entry``'s queued work; its futures are cancelled once its running op ends."""
        with self._cv:
            entry.cancelled = True
            if entry.assigned is None:
                self.cancel_futures(entry)
            self._cv.notify_all()

    def retire(self, entry: TaskRecord) -> None:
        """Before the registry forgets ``entry``: cancel it, wait for its running op, bring
        its states home for good and forget it in the policy."""
        with self._cv:
            self.cancel(entry)
            while entry.assigned is not None and not self._closed:
                self._cv.wait(_POLL_S)
            self.offload(entry, leave=True)
            self.policy.forget(entry.name)
            self._waits.forget(entry.name)

    def stop(self) -> bool:
        """Cancel every task and end the dispatch thread (the workers go on); False if it
        was stopped already."""
        with self._cv:
            if self._closed:
                return False
            self._closed = True
            for entry in self._tasks.values():
                entry.cancelled = True
            self._cv.notify_all()
        self._thread.join(5.0)
        return True

    def release_all(self) -> None:
        """After :meth:`stop` and the workers' end: every task's states home (those on disk
        left there) and its futures cancelled."""
        with self._cv:
            for entry in self._tasks.values():
                # States on disk are not read back (all of them may not fit in host
                # memory): they stay readable views of their files, whose disk space is
                # freed once nothing uses them.
                self.offload(entry, leave=True, load=False)
                self.cancel_futures(entry)

    def offload(self, entry: TaskRecord, leave: bool = False, load: bool = True) -> None:
        """Bring the task's states home from the devices (for good: a prefetch in a queue
        leaves them there). ``leave``: the task leaves the engine: its states are the
        user's again, and with ``load`` those on disk come back into host memory."""
        runner = entry.runner
        stores = stores_of(runner)
        if leave:
            self.host.unregister(stores)
        for i in range(len(entry.plan)):
            store = runner.store_of(i)
            with store.lock:  # a prefetch may be bringing it in right now: after it
                if isinstance(store.owner, DeviceWorker):
                    store.owner.evict(store)  # counted there until copied out, and traced
                store.retire(load=leave and load)
            for w in self.workers:
                w.release(store)
        if leave:
            self.host.discard(stores)

    def cancel_futures(self, entry: TaskRecord) -> None:
        """Cancel ``entry``'s futures and revoke its grants (its runner stopped, its
        batch dropped)."""
        entry.runner.stop()
        self._kept.end(entry, drop=True)
        for p in entry.pending:
            p.future.cancel()
        entry.pending.clear()
        entry.granted = 0

    # -- completion -----------------------------------------------------------------------

    def _advance(self, entry: TaskRecord) -> None:
        """The runner's next op, after its current one completed or a grant came; an
        iteration that ends is the engine's to count and deliver, and the next one
        starts only while iterations are granted."""
        runner = entry.runner
        try:
            was = runner.current
            if runner.advance() is None and was is not None:
                entry.end_iteration()  # resolves the caller's wait (a loop's user thread)
                if entry.granted > 0:
                    runner.advance()
        except BaseException as err:  # a task's error stays with the task
            self._fail(entry, err)

    def _fail(self, entry: TaskRecord, err: BaseException) -> None:
        log.info("task %r failed: %s: %s", entry.name, type(err).__name__, err)
        if not isinstance(err, TuneHydraError):
            tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            wrapped = TaskFailedError(entry.name, f"{type(err).__name__}: {err}", tb)
            wrapped.__cause__ = err
            err = wrapped
        # The callers get the error itself; the engine keeps a copy without frames (a
        # later grant raises a copy of it): raised in a caller's thread, the error gets
        # that thread's frames in its traceback (a th.shard loop's: the user's model),
        # which the task's record would keep alive, and with it the task (#29).
        entry.error = _frameless(err)
        entry.runner.stop()
        entry.granted = 0
        self._kept.end(entry, drop=True)
        for p in entry.pending:
            p.future.set_exception(err)
        entry.pending.clear()

    def _on_done(
        self,
        entry: TaskRecord,
        a: Assignment,
        err: BaseException | None,
        release: Store | None = None,
    ) -> None:
        if release is not None:
            self.host.use(release.parts(), -1)
        with self._cv:
            worker = entry.assigned
            if worker is not None:
                worker.finished(a, entry.name)
            entry.assigned = None
            entry.op_done(a.op, a.duration)
            # A state of this task that could not be written to the disk tier while the
            # op ran fails it now, before the op can end its call: the dispatcher thread's
            # poll may come only after the task finished (its call would then succeed).
            self._spill_failures()
            failed = err is not None or entry.error is not None
            if not failed:
                per_batch = a.duration / max(1, a.op.count)
                entry.record(a.op.kind.value, a.op.shard, per_batch)
                self._op_sum += per_batch
                self._op_n += 1
            if err is not None:
                self._fail(entry, err)
            elif failed:
                pass  # failed by its spill (its calls raise the write error), not advanced
            elif entry.cancelled:
                self.cancel_futures(entry)
            else:
                self._advance(entry)
                self._kept.end(entry)
                entry.ready_since = self.clock()
            wake = failed or entry.cancelled or self._closed
            if not wake and worker is not None and self._kept.active:
                # A loop between ops: its device waits (anticipate.py), graphs kept only.
                wake = self._waits.after_op(entry, worker, self.clock())
            if not self._closed and self._broken is None:
                # Dispatch right here instead of waking the dispatcher thread: one thread
                # hand-off less per operation. A policy error resurfaces in _loop.
                try:
                    self._dispatch()
                except Exception as e:
                    log.debug("dispatch after %s raised %r; the dispatcher thread retries", a.op, e)
                    wake = True
            if wake:  # waking the dispatcher on every op would contend for the GIL
                self._cv.notify_all()

    # -- ops run along with another task's assignment (Engine(batch_shared=True)) -------

    def tasks_along(self) -> list[TaskRecord]:
        """The tasks, for the batcher to pick ops to run along (under the engine's lock)."""
        return list(self._tasks.values())

    def assign_along(self, entry: TaskRecord, w: DeviceWorker) -> None:
        """``entry``'s current op runs on ``w`` along with the op assigned there now."""
        entry.assigned = w

    def drop_along(self, entry: TaskRecord) -> None:
        """``entry``'s op, taken out of the batched pass it was to run along with (no room
        for its state then), is ready again (under the engine's lock)."""
        entry.assigned = None
        self._cv.notify_all()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The engine's lock, for a worker's thread (a group closing as its op starts)."""
        with self._cv:
            yield

    def done_along(self, entry: TaskRecord, a: Assignment, err: BaseException | None) -> None:
        """``entry``'s op run along ended (``err``: its own error): as one of its own."""
        self._on_done(entry, a, err)

    # -- the dispatch thread and its decisions -------------------------------------------

    def _loop(self) -> None:
        try:
            with self._cv:
                while not self._closed:
                    for w in self.workers:
                        if not w.alive or w.last_error is not None:
                            raise ScheduleError(
                                f"the worker of device {w.label} stopped ({w.last_error!r}); "
                                f"this is a tune_hydra bug, please report it"
                            ) from w.last_error
                    self._kept.audit(self._tasks, self.workers)
                    self._spill_failures()
                    self._dispatch()
                    self._cv.wait(self._waits.timeout(_POLL_S, self.clock()))
        except BaseException as err:  # surface to every waiting caller
            with self._cv:
                self._broken = err
                for entry in self._tasks.values():
                    if entry.pending:
                        self._fail(entry, err)

    def _spill_failures(self) -> None:
        """Fail the tasks whose state could not be written to the disk tier."""
        for name, err in self.host.take_failures():
            entry = self._tasks.get(name)
            if entry is not None and entry.error is None:
                self._fail(entry, err)

    def _outlook(self) -> None:
        """Tell the host memory manager how soon each state will be visited: tasks in
        the order the policy would run them (those on a device first), ``len(devices)``
        at a time, each from its current op on (see ``Program.ops_until``)."""
        default_op_s = self._op_sum / self._op_n if self._op_n else 1.0
        live = [
            e
            for e in self._tasks.values()
            if e.error is None and not e.cancelled and e.runner.current is not None
        ]
        running = [e for e in live if e.assigned is not None]
        waiting = [e for e in live if e.assigned is None]
        cands = [
            self._offer(e, op, None, default_op_s)
            for e in waiting
            if (op := e.runner.current) is not None
        ]
        by_op = {id(c.op): e for c, e in zip(cands, waiting, strict=True)}
        ranked = running + [by_op[id(c.op)] for c in self.policy.rank(cands)]
        heat: dict[int, float] = {}
        per_slot = max(1, len(self.workers))
        for i, e in enumerate(ranked):
            runner = e.runner
            op = runner.current
            order = runner.order
            base = (i // per_slot) * order.ops_per_batch
            for shard in range(len(e.plan)):
                h = base + order.ops_until(op, shard)
                for s in runner.store_of(shard).parts():
                    heat[id(s)] = min(h, heat.get(id(s), h))
        self.host.set_outlook(heat)

    def _dispatch(self) -> None:
        if self._held:  # hold(): decided on leaving it
            return
        if self.host.active:
            self._outlook()
        # Idle devices first; only then queue a second (prefetched) op on busy ones.
        for level in range(1, self._max_depth + 1):
            for w in self.workers:
                if len(w.assigned) < min(level, w.depth) and not self._fill(w):
                    return

    def _fill(self, w: DeviceWorker) -> bool:
        """Offer ``w`` every ready op and give it the one the policy picks (if any); False
        when no task is ready at all (only then may the dispatch stop early)."""
        # A task not measured yet is estimated like the average task so far (not as
        # "infinitely long", which would make LRTF alternate on cold estimates).
        default_op_s = self._op_sum / self._op_n if self._op_n else 1.0
        # The common case made cheap (a decision per op, a check per ready task): on a
        # device that computes in host memory with nothing queued, no disk tier and no
        # kept graphs, a task's last offer still holds while its op, its estimate's basis
        # and whether it ran here last are unchanged (what _offer checks, without its
        # store); anything else goes through _offer.
        plain = not (w.copy or w.assigned or self.host.active or self._kept.active)
        last = w.last_task
        cands = []
        entries = []
        # Engine(batch_shared=True): with every device busy, an op of a shared shard runs
        # along with the same op of another task queued already (on an idle device it
        # runs now instead: the ops ready with it go along there).
        now = self.clock()
        waits_for = None if w.assigned else self._waits.holder(w, now)
        batcher = self.batcher
        if batcher is not None and not self._waits.all_busy(self.workers, now):
            batcher = None
        for e in self._tasks.values():
            op = e.runner.current
            if e.assigned is not None or e.error is not None or e.cancelled or op is None:
                continue
            if not self._waits.may_take(e, w, waits_for, now):
                continue  # w waits for another loop, or another device for this one
            if batcher is not None and batcher.join(self, e, op):
                continue
            c = e.candidate
            if not (
                plain
                and c is not None
                and c.op is op
                and c.resident is (last == e.name)
                and c.fits
                and c.in_host
                and not c.bring_in_bytes
                and (e.known_n or e.offered_s == default_op_s)
            ):
                c = self._offer(e, op, w, default_op_s)
            cands.append(c)
            entries.append(e)
        if not cands:
            return waits_for is not None  # waiting is not "nothing ready anywhere"
        i = decide(self.policy, w.index, cands)
        if i is not None:
            if entries[i] is waits_for:
                self._waits.release(w)
            self._assign(w, entries[i], cands[i].op)
        return True

    def _offer(
        self, e: TaskRecord, op: Op, w: DeviceWorker | None, default_op_s: float
    ) -> Candidate:
        """The candidate ``e``'s ready ``op`` is offered as for device ``w`` (``None``: for
        no device, to rank the tasks); the engine's one place that builds candidates."""
        store = e.runner.store_of(op.shard)
        in_host = not store.on_disk if self.host.active else True
        if w is None:
            return offer(
                op,
                e.remaining_s(default_op_s),
                ready_since=e.ready_since,
                order=e.order,
                in_host=in_host,
                milestone_s=e.milestone_s(default_op_s),
            )
        shared = 0
        if w.copy:
            res = w.holds(store)
            # A shared frozen base already there for other tasks is not copied again.
            shared = 0 if res else shared_on_device(store, w)
            bring = 0 if res else max(0, store.state_bytes - shared)
        else:  # computes in host memory: "resident" is the task that ran here last
            res = w.last_task == e.name
            bring = 0
        # Not now: its batch's graph is on another device, or has no room here, or its
        # shard would not fit beside the op(s) queued here.
        fits = not (self._kept.active and self._kept.blocks(e, op, w)) and (
            not w.assigned or w.fits(store)
        )
        c = e.candidate
        # A task's offer changes only with its own op or grant (both reset it), and with
        # where its shard is; a task not measured yet follows the engine-wide mean.
        if (
            c is None
            or c.op is not op
            or c.resident is not res
            or c.fits is not fits
            or c.in_host is not in_host
            or c.bring_in_bytes != bring
            or c.shared_bytes != shared
            or (not e.known_n and e.offered_s != default_op_s)
        ):
            e.offered_s = default_op_s
            c = e.candidate = offer(
                op,
                e.remaining_s(default_op_s),
                ready_since=e.ready_since,
                order=e.order,
                resident=res,
                in_host=in_host,
                fits=fits,
                bring_in_bytes=bring,
                milestone_s=e.milestone_s(default_op_s),
                shared_bytes=shared,
            )
        return c

    def _assign(self, w: DeviceWorker, entry: TaskRecord, op: Op) -> None:
        # A shard another device holds stays counted there until it is copied out (by
        # that device's LRU eviction, or by this device's copy thread taking it over).
        runner = entry.runner
        store = runner.store_of(op.shard)
        self._kept.begin(entry, op, w)
        a = Assignment(
            op,
            store,
            run=lambda dev: runner.execute(op, dev),
            done=lambda a, err: self._on_done(entry, a, err),
        )
        if self.batcher is not None:  # other tasks' ops on the same shared shard run with it
            self.batcher.open(self, w, entry, op, a)
        entry.assigned = w
        if self.host.active and not w.copy:
            # A device that computes in host memory uses the host tensors themselves: they
            # must not go to disk from now until the op ends (a copying device computes on
            # its copies; its promotion reads a state back from disk if need be).
            self.host.use(store.parts(), 1)
            a.done = lambda a, err: self._on_done(entry, a, err, release=store)
        if log.isEnabledFor(logging.DEBUG):  # a decision per op: format only when asked
            resident = w.holds(store) if w.copy else w.last_task == entry.name
            log.debug("%s -> %s%s", op, w.label, " (resident)" if resident else "")
        w.submit(a)
        if w.depth > 1:
            # A task's next op is not ready until this one ends, so the dispatcher cannot
            # queue it yet; its shard is known, though: copy it in while this one computes.
            nxt = runner.order.next_shard(op)
            if nxt is not None:
                w.prefetch(runner.store_of(nxt), op.task, nxt, op.iteration)


def _frameless(err: BaseException, depth: int = 0) -> BaseException:
    """A copy of ``err`` without a traceback (no frames: what the engine may keep): its
    type, arguments and attributes, its ``__cause__`` copied likewise (a
    ``TaskFailedError`` keeps the original traceback as text). An error that does not
    copy becomes a ``TuneHydraError`` with its type, message and traceback as text."""
    try:
        kept = copy.copy(err)
    except Exception:
        kept = None
    if type(kept) is not type(err) or kept is err:
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        kept = TuneHydraError(f"{type(err).__name__}: {err}\n\nOriginal traceback:\n{tb}")
    assert kept is not None
    kept.__traceback__ = None
    cause = err.__cause__
    kept.__cause__ = None if cause is None or depth > 8 else _frameless(cause, depth + 1)
    kept.__context__ = None
    kept.__suppress_context__ = True
    return kept


__all__ = ["Dispatcher"]
