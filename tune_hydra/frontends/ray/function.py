"""Function trainables (``def train(config): ... tune.report(...)``) under a
:class:`~tune_hydra.HydraExecutor`.

The user's function runs in its node's engine process, in a thread of its own, so that
``th.shard`` there trains on that node's engine, multiplexed with every other trial. Tune
keeps running a proxy trial per function, :class:`HydraFunctionTrainable`: a Tune
``FunctionTrainable`` whose own function is a *relay*. It starts the user's function in
the engine actor (with the trial's config, context and the checkpoint Tune restored), then
takes each of the user's reports from there and reports it with its real Tune session. So
everything Tune does with a function trainable stays Tune's: checkpoints are persisted by
the proxy's session from the node-local folder the user wrote, PBT exploits, HyperBand
pauses, ``Tuner.restore`` and ``checkpoint_config`` restart or resume the function as
plain Tune does (``tune.get_checkpoint()`` in the restarted function).

In the engine process, :class:`FunctionRun` is the trial's side: its thread runs the
user's function

* inside an ``EngineScope`` of the engine (``th.shard`` without ``engine=`` goes there;
  the loops it made leave the engine when the function ends, fails or is stopped),
* on a private random generator for the function's whole life (as task factories and
  ``th.optimize``'s objectives: :func:`tune_hydra.engine.registration.factory.private_rng`),
* in its own working directory, the trial's directory as in plain Tune
  (``unshare(CLONE_FS)`` for that thread alone, then ``chdir``: relative paths of two
  trials never collide),

and is the session that Ray's ``tune.report`` / ``train.report`` / ``tune.get_checkpoint``
/ ``tune.get_context()`` read there: Ray keeps one process-global session
(``ray.train._internal.session._session``), which in an engine process is a
:class:`SessionRouter` that hands each thread its own trial's :class:`FunctionRun`. A
report blocks the function until the proxy took it and Tune asked for the next result (as
Tune's own session does): a paused or stopped trial does not run ahead.

Cost: one Ray call from the proxy to the engine actor per report, measured at 2.7-4.1 ms
a report on a loaded 2-core machine (a function that only reports, 200 times; plain
Tune's own session: 0.12-0.16 ms), nothing beside an epoch of training.

This module imports neither torch nor the engine at import time (trial processes import
it); the engine side loads them in the engine actor.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import inspect
import logging
import math
import os
import sys
import threading
import traceback
import uuid
from collections import deque
from collections.abc import Callable
from numbers import Number
from typing import Any, ClassVar

from ray.train._internal import session as ray_session
from ray.tune.result import DEFAULT_METRIC, RESULT_DUPLICATE
from ray.tune.trainable.function_trainable import FunctionTrainable

from tune_hydra.exceptions import SystematicTaskError
from tune_hydra.frontends.ray.client import EngineClient
from tune_hydra.frontends.ray.errors import (
    NoShardError,
    ReportThreadError,
    TrialFunctionError,
)

logger = logging.getLogger(__name__)

_CLONE_FS = 0x00000200  # linux/sched.h: the cwd, root and umask of a thread
# A loop's milestone in ops before its ops per report are known: far, so that it is
# served as a trial with a milestone ahead (as th.optimize's objectives).
_UNKNOWN_OPS = 1_000_000
_UNSET: Any = object()

SHARD_LINE = "model, optimizer = th.shard(model, optimizer)"


class _Stopped(BaseException):
    """Ends a stopped trial's function at its next report (a ``BaseException``, so the
    user's ``except Exception`` does not keep it running, as Tune's ``sys.exit`` does)."""


# ------------------------------------------------------------------ engine process side
class SessionRouter:
    """Ray's process-global Tune session in an engine process: every attribute is the
    calling thread's trial's (:class:`FunctionRun`); other threads get a clear error.

    Always true, so Ray's ``tune.report`` called from a thread the user started asks for
    an attribute (and gets the error) instead of warning and returning None.
    """

    def __init__(self) -> None:
        self._runs: dict[int, FunctionRun] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return True

    def bind(self, run: FunctionRun) -> None:
        """The calling thread is ``run``'s."""
        with self._lock:
            self._runs[threading.get_ident()] = run

    def unbind(self) -> None:
        """The calling thread's function ended."""
        with self._lock:
            self._runs.pop(threading.get_ident(), None)

    def current(self) -> FunctionRun | None:
        """The calling thread's trial, or None."""
        return self._runs.get(threading.get_ident())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        run = self.current()
        if run is None:
            raise ReportThreadError(
                f"Ray's Tune session ({name}: tune.report, train.report, "
                f"tune.get_checkpoint or tune.get_context) was used from the thread "
                f"{threading.current_thread().name!r}, which is not a trial's: under a "
                f"HydraExecutor each trial's function runs in a thread of the node's engine "
                f"process, and only that thread has the trial's session. Call tune.report "
                f"from the function itself (hand the metrics back from your thread, e.g. "
                f"with a queue.Queue or a concurrent.futures.Future)"
            )
        return getattr(run, name)


_ROUTER_LOCK = threading.Lock()


def session_router() -> SessionRouter:
    """Install (once per process) and return the :class:`SessionRouter` as Ray's session.

    Raises:
        ReportThreadError: the process already has a Tune session of its own (a function
            trainable's engine must be an engine actor, not a Tune trial).
    """
    with _ROUTER_LOCK:
        current = ray_session._session
        if isinstance(current, SessionRouter):
            return current
        if current is not None:
            raise ReportThreadError(
                "this process already runs a Ray Tune session of its own, so it cannot host "
                "the sessions of a HydraExecutor's function trainables; they run in the "
                "executor's engine actors"
            )
        router = SessionRouter()
        ray_session._session = router  # type: ignore[assignment]
        return router


def own_working_directory(path: str) -> bool:
    """Give the calling thread its own working directory ``path`` (made if missing), as
    plain Tune chdirs each trial's process into its trial directory. Threads share their
    process's cwd, so the thread first unshares it (Linux ``unshare(CLONE_FS)``): the
    other threads keep theirs. Returns False (cwd unchanged) where that is not possible.
    """
    os.makedirs(path, exist_ok=True)
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_FS) != 0:
            logger.warning(
                "tune_hydra: unshare(CLONE_FS) failed (%s): the function keeps the engine "
                "process's working directory, not its trial directory",
                os.strerror(ctypes.get_errno()),
            )
            return False
    except (OSError, AttributeError):
        return False
    os.chdir(path)
    return True


class FunctionRun:
    """One trial's function in the engine process: its thread, the reports on their way
    to the proxy, and the trial's Tune session as Ray's functions read it (through the
    :class:`SessionRouter`: ``report``, ``loaded_checkpoint``, ``trial_info``,
    ``trial_name``, ``trial_id``, ``trial_dir``, ``experiment_name``, ``storage`` ...).

    Items for the proxy (:meth:`take`): ``("report", metrics, checkpoint)``,
    ``("error", text, systematic error or None)``, ``("done", None, None)``.

    Args:
        fn: the user's function (``tune.with_parameters`` bound).
        config: the trial's config.
        key: the trial id; token: its proxy's ownership token.
        engine: the engine its ``th.shard`` calls train on.
        context: from the proxy's session: ``trial_info`` (Ray's ``TrialInfo``),
            ``storage`` (its ``StorageContext``), ``cwd`` (the trial's working directory)
            and ``checkpoint`` (what ``tune.get_checkpoint()`` returns at the start).
        seed: the private generator's seed (None: random, as a fresh process).
    """

    # What Ray's functions read of a Tune function trainable's session.
    world_rank = local_rank = node_rank = local_world_size = world_size = None
    dataset_shard = None
    metadata = None
    accelerator = None
    synchronous_result_reporting = True
    # Whether the run ends only when its proxy (or the driver, for a failed trial) ends
    # it: a class trainable's instance, which Tune may keep (reuse_actors) after its
    # trial completed or moved to another proxy.
    proxy_owned = False

    def __init__(
        self,
        fn: Any,
        config: dict[str, Any],
        *,
        key: str,
        token: str,
        engine: Any,
        context: dict[str, Any],
        seed: int | None = None,
    ) -> None:
        self.fn = fn
        self.title = self._name()  # for messages, also once fn is dropped
        self.config = config
        self.key = key
        self.token = token
        self.engine = engine
        self.seed = seed
        self.trial_info = context.get("trial_info")
        self.storage = context.get("storage")
        self.cwd = context.get("cwd")
        self.loaded_checkpoint = context.get("checkpoint")
        self.scope: Any = None
        self.reports = 0
        self._state: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._items: deque[tuple[str, Any, Any]] = deque()
        self._waiter: concurrent.futures.Future[tuple[str, Any, Any]] | None = None
        self._held = False  # a report was handed to the proxy and waits to go on
        self._continue = threading.Semaphore(0)
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._main, name=f"hydra-fn-{key}", daemon=True)
        # The driver's hints (in reports: Tune results), turned into ops of its loops.
        self._loops: dict[str, tuple[Any, int]] = {}  # name -> (loop, ops at last report)
        self._per_report: dict[str, float] = {}  # name -> ops between two reports
        self._milestone: Any = _UNSET  # reports to the next milestone (None: none left)
        self._remaining: int | None = None  # reports after the current one
        # The ops a report of a new loop will take, where the trial knows it before the
        # loop's first report (a task factory's loop: from its task and cut).
        self.guess: Callable[[Any], float | None] | None = None

    # -- Ray's session attributes ----------------------------------------------------
    @property
    def trial_name(self) -> str:
        return str(getattr(self.trial_info, "name", ""))

    @property
    def trial_id(self) -> str:
        return str(getattr(self.trial_info, "id", self.key))

    @property
    def trial_dir(self) -> str:
        return str(getattr(self.trial_info, "logdir", ""))

    @property
    def experiment_name(self) -> str:
        return str(getattr(self.trial_info, "experiment_name", ""))

    @property
    def run_id(self) -> str:
        return str(getattr(self.trial_info, "run_id", ""))

    @property
    def trial_resources(self) -> Any:
        return getattr(self.trial_info, "resources", None)

    def get_state(self, key: str) -> Any:
        return self._state.get(key)

    def set_state(self, key: str, value: Any) -> None:
        self._state[key] = value

    def get_dataset_shard(self, *args: Any, **kwargs: Any) -> Any:
        return None  # a Tune function trainable has no dataset shard

    def report(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        """The user's ``tune.report``: hand the result to the proxy and wait until Tune
        asks for the next one (or stops the trial: then the function ends here)."""
        if self._stopped.is_set():
            raise _Stopped
        if "torch" in sys.modules:
            from ray.air._internal.torch_utils import contains_tensor

            if contains_tensor(metrics):
                raise ValueError(
                    "Passing objects containg Torch tensors as metrics is not supported: "
                    "convert them to Python numbers (loss.item()), or save tensors in a "
                    "checkpoint"
                )
        if RESULT_DUPLICATE not in metrics and self.scope is not None and not self.scope.sharded:
            err = NoShardError(
                self.key,
                f"the function trainable {self.title} reported without calling th.shard, "
                f"so it trained plainly beside the engine (one trial at a time per node "
                f"gains nothing from a HydraExecutor)",
                f"Add `{SHARD_LINE}` after building the model and the optimizer, or run it "
                f"without trial_executor (plain tune.run)",
            )
            self._put(("error", str(err), err))
            raise _Stopped
        self.reports += 1
        self._measure()
        self._put(("report", dict(metrics), checkpoint))
        self._continue.acquire()
        if self._stopped.is_set():
            raise _Stopped

    # -- the engine's hints: Tune's budget and milestones, in ops of the loops ----------
    def add_loop(self, loop: Any) -> None:
        """``EngineScope.on_loop``: a loop of the function was cut and registered."""
        per = self.guess(loop) if self.guess is not None else None
        with self._lock:
            self._loops[loop.name] = (loop, loop.iteration)
            if per is not None:
                self._per_report.setdefault(loop.name, per)
        self._announce()

    def hint(self, *, milestone: Any = _UNSET, remaining: int | None = None) -> None:
        """The driver's ``set_milestone`` (reports from the last one to the trial's next
        milestone; None: none left) or ``set_remaining`` (reports after the next one)."""
        with self._lock:
            if milestone is not _UNSET:
                self._milestone = milestone
            if remaining is not None:
                self._remaining = remaining
        self._announce()

    def _measure(self) -> None:
        """At a report: the ops each loop ran since the last one, and the loops' progress
        (their ops' iteration, which the milestone policy reads)."""
        with self._lock:
            for name, (loop, at) in list(self._loops.items()):
                ops = loop.iteration
                if ops > at:
                    self._per_report[name] = float(ops - at)
                self._loops[name] = (loop, ops)
                loop.reports = self.reports

    def _announce(self) -> None:
        """Tell the engine each loop's next milestone and remaining work, in its ops
        (half a report of slack: a report that takes an op or two more than the last
        one is not taken for committed work)."""
        with self._lock:
            loops = [(name, loop) for name, (loop, _) in self._loops.items()]
            per_report = dict(self._per_report)
            milestone, remaining = self._milestone, self._remaining
        for name, _loop in loops:
            per = per_report.get(name)
            with contextlib.suppress(Exception):  # the loop left (unshard): no hint
                if milestone is not _UNSET:
                    ops = (
                        None
                        if milestone is None
                        else _UNKNOWN_OPS
                        if per is None
                        else max(1, math.ceil((milestone + 0.5) * per))
                    )
                    self.engine.set_milestone(name, ops)
                if remaining is not None and per is not None:
                    self.engine.set_remaining(name, math.ceil((remaining + 1) * per))

    def _name(self) -> str:
        fn = getattr(self.fn, "fn", self.fn)
        return repr(getattr(fn, "__name__", type(fn).__name__))

    # -- the proxy's side ---------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def take(self, persisted: Any = None) -> concurrent.futures.Future[tuple[str, Any, Any]]:
        """The next item for the proxy; the report handed over before (if any) goes on.
        ``persisted``: the checkpoint the proxy's session persisted from that report
        (``tune.get_checkpoint()`` returns it from now on, as in plain Tune)."""
        future: concurrent.futures.Future[tuple[str, Any, Any]] = concurrent.futures.Future()
        with self._lock:
            if persisted is not None:
                self.loaded_checkpoint = persisted
            if self._held:
                self._held = False
                self._continue.release()
            if self._items:
                item = self._items.popleft()
                self._held = item[0] == "report"
                future.set_result(item)
            else:
                self._waiter = future
        return future

    def _put(self, item: tuple[str, Any, Any]) -> None:
        with self._lock:
            waiter, self._waiter = self._waiter, None
            if waiter is not None and not waiter.done():
                self._held = item[0] == "report"
                waiter.set_result(item)
            else:
                self._items.append(item)

    def stop(self) -> None:
        """Tune stopped or paused the trial (or it was replaced): the function ends at
        its next forward (``ShardClosedError``) or report, its loops leave the engine,
        and its thread ends. Never blocks."""
        self._stopped.set()
        scope = self.scope
        if scope is not None:
            scope.stop()
        self._continue.release()
        self._put(("done", None, None))

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    # -- the function's thread --------------------------------------------------------------
    def _main(self) -> None:
        from tune_hydra.engine.registration.factory import private_rng
        from tune_hydra.frontends.shard import engine_scope

        router = session_router()
        router.bind(self)
        item: tuple[str, Any, Any] = ("done", None, None)
        try:
            if self.cwd:
                own_working_directory(str(self.cwd))
            with private_rng(self.seed), engine_scope(self.engine) as scope:
                self.scope = scope
                scope.on_loop = self.add_loop
                if self._stopped.is_set():
                    scope.stop()
                try:
                    self._call_function()
                finally:
                    scope.close()  # nothing of it stays queued or resident
            self._finish()
        except _Stopped:
            pass
        except BaseException as err:  # the proxy reports it, whatever it is
            if not self._stopped.is_set():
                text = "".join(traceback.format_exception(err))
                item = (
                    "error",
                    f"trial {self.key}: the function trainable {self.title} raised in the "
                    f"engine process:\n{text}",
                    err if isinstance(err, SystematicTaskError) else None,
                )
        finally:
            router.unbind()
            # A run lives on in a reference cycle with its thread until the collector
            # runs: what it ran (a closure over a dataset) is freed with the trial.
            self.fn = self.guess = None
            with self._lock:
                self._loops.clear()
            self._put(item)

    def _finish(self) -> None:
        """After the function returned: as Tune's function wrapper, the last result
        again, marked as such."""
        self.report({RESULT_DUPLICATE: True})

    def _call_function(self) -> None:
        """Call the function as Tune's ``wrap_function`` does: a returned or yielded dict
        (or number) is reported too."""
        output = self.fn(self.config)
        if inspect.isgenerator(output):
            for out in output:
                self._report_output(out)
        else:
            self._report_output(output)

    def _report_output(self, output: Any) -> None:
        if not output:
            return
        if isinstance(output, dict):
            self.report(output)
        elif isinstance(output, Number):
            self.report({DEFAULT_METRIC: output})
        else:
            raise ValueError(
                "Invalid return or yield value. Either return/yield a single number or a "
                "dictionary object in your trainable function."
            )


# ------------------------------------------------------------------- trial process side
class HydraFunctionTrainable(EngineClient, FunctionTrainable):
    """The proxy of one function trainable (made by :meth:`HydraExecutor.trainable
    <tune_hydra.HydraExecutor.trainable>`): a Tune ``FunctionTrainable`` whose function
    relays the user's function running in the engine actor (see the module docstring).

    Class attributes: as :class:`~tune_hydra.frontends.ray.client.EngineClient`'s
    (``_factory_id`` names the stored function); ``_param_refs`` the references of
    ``tune.with_parameters`` around this class.
    """

    _required_metrics: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def for_function(
        cls, name: str, *, factory_id: str, run_id: str, secret: str, slot_resource: str
    ) -> type[HydraFunctionTrainable]:
        """The proxy class of one stored function."""
        return type(
            f"Hydra_{name}",
            (cls,),
            {
                "_name": name,
                "_factory_id": factory_id,
                "_run_id": run_id,
                "_secret": secret,
                "_slot_resource": slot_resource,
                "__module__": cls.__module__,
            },
        )

    def setup(self, config: dict[str, Any], **params: Any) -> None:
        super().setup(config)
        self._token = uuid.uuid4().hex
        self._started: str | None = None  # the trial id the engine runs the function for
        self._actor = None
        self._slot_checked = False
        self._params: dict[str, Any] = {**self._param_refs, **params}

    def _trainable_func(self, config: dict[str, Any]) -> None:
        """The relay (in the proxy's runner thread): start the user's function in the
        engine actor, then report each of its results with this trial's Tune session."""
        session = ray_session.get_session()
        assert session is not None
        key = self.trial_id
        try:
            self._check_slot()
        except SystematicTaskError as err:
            self._record(err)
            raise
        context = {
            "trial_info": session.trial_info,
            "storage": session.storage,
            "cwd": session.storage.trial_working_directory,
            "checkpoint": session.loaded_checkpoint,
        }
        self._call(
            "fn_start",
            key,
            self._token,
            self._factory_id,
            dict(config),
            self._params,
            self._secret,
            context,
        )
        self._started = key
        persisted = None
        while True:
            kind, payload, extra = self._call("fn_next", key, self._token, persisted, retry=False)
            if kind == "done":
                return
            if kind == "error":
                if isinstance(extra, SystematicTaskError):
                    self._record(extra)
                    raise extra
                raise TrialFunctionError(payload)
            session.report(payload, checkpoint=extra)  # waits here for Tune's next step
            persisted = session.loaded_checkpoint if extra is not None else None

    def _stop_function(self) -> None:
        key, self._started = self._started, None
        if key is not None and self._actor is not None:
            with contextlib.suppress(Exception):  # a dead engine holds nothing of it
                self._call("fn_stop", key, self._token, retry=False)

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        self._stop_function()
        return bool(super().reset_config(new_config))

    def cleanup(self) -> None:
        # The engine side first: the relay may wait there for a report that never comes.
        self._stop_function()
        super().cleanup()


__all__ = [
    "FunctionRun",
    "HydraFunctionTrainable",
    "SessionRouter",
    "own_working_directory",
    "session_router",
]
