"""The engine actor's side of class trainables: the runs of the trials' ``tune.Trainable``
instances in this engine process, by their proxy's token (see
:mod:`tune_hydra.frontends.ray.classes`).

A proxy keeps its run when Tune resets it for another trial (``reuse_actors``), so a run
is addressed by the proxy's token, not by the trial id; under its current trial id it is
also one of the :class:`~tune_hydra.frontends.ray.function_relay.FunctionRelay`'s runs
(the driver's hints, stops and deregistrations reach it there).

This module imports neither torch nor the engine at import time (trial processes import
the actor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

from tune_hydra.exceptions import TuneHydraError
from tune_hydra.frontends.failures import portable
from tune_hydra.frontends.ray.errors import RETRY, TrialNotRegisteredError

if TYPE_CHECKING:
    from tune_hydra.frontends.ray.classes import ClassRun
    from tune_hydra.frontends.ray.function_relay import FunctionRelay


class ClassRelay:
    """The class-trainable runs of one engine actor: builds each proxy's instance,
    forwards the proxy's calls to it, resets it for another trial and ends it.

    Args:
        functions: the actor's function runs, where each class run is launched under its
            trial id.
    """

    def __init__(self, functions: FunctionRelay) -> None:
        self._functions = functions
        self._lock = threading.Lock()  # touched from two event-loop threads
        self._runs: dict[str, ClassRun] = {}  # by proxy token

    async def start(
        self,
        cls: type,
        params: dict[str, Any],
        config: dict[str, Any],
        *,
        key: str,
        token: str,
        engine: Any,
        context: dict[str, Any],
        seed: int | None,
        spec: Any = None,
    ) -> None:
        """Build trial ``key``'s instance of ``cls`` (its ``setup`` runs, with
        ``params``; a canned class reads ``spec`` from its run) on a thread of its own,
        on ``engine``, for the proxy ``token``; it replaces (stops) an older run of the
        proxy and of the trial.

        Raises:
            TrialFunctionError: the class's ``__init__`` / ``setup`` raised.
        """
        from tune_hydra.frontends.ray.classes import ClassRun

        run = ClassRun(
            cls,
            dict(config),
            key=key,
            token=token,
            engine=engine,
            context=context,
            seed=seed,
            params=params,
            spec=spec,
        )
        with self._lock:
            old = self._runs.get(token)
            self._runs = {t: r for t, r in self._runs.items() if not r.stopped}
            self._runs[token] = run
        if old is not None:
            old.stop()
        self._functions.launch(key, run)
        try:
            await self._result(run.call("setup"))
        except BaseException:
            # Nothing to train: the run ends now rather than at its proxy's cleanup.
            with self._lock:
                if self._runs.get(token) is run:
                    del self._runs[token]
            self._functions.discard(run)
            run.stop()
            raise

    def _run(self, token: str) -> ClassRun:
        with self._lock:
            run = self._runs.get(token)
        if run is None or run.stopped:
            raise TrialNotRegisteredError(
                f"this trial's class trainable does not run in this engine (the engine "
                f"actor restarted, or the trial was stopped or replaced). {RETRY}"
            )
        return run

    @staticmethod
    async def _result(future: concurrent.futures.Future[Any]) -> Any:
        try:
            return await asyncio.wrap_future(future)
        except TuneHydraError as err:
            raise portable(err) from None

    async def call(
        self, token: str, method: str, args: tuple[Any, ...], counters: dict[str, Any]
    ) -> Any:
        """Call ``method`` of the proxy ``token``'s instance on its thread, with the
        proxy's iteration counters; returns what it returns."""
        run = self._run(token)
        return await self._result(run.call(method, tuple(args), counters))

    async def reset(
        self,
        token: str,
        new_key: str,
        config: dict[str, Any],
        context: dict[str, Any],
        counters: dict[str, Any],
    ) -> bool:
        """Reset the proxy ``token``'s instance for trial ``new_key`` (Tune's
        ``Trainable.reset``); on success the run serves ``new_key`` from now on. Returns
        what ``reset_config`` returned."""
        run = self._run(token)
        old_key = run.key
        ok = bool(await self._result(run.call("reset", (dict(config), context, new_key), counters)))
        if ok and new_key != old_key:
            self._functions.rekey(run, old_key, new_key)
        return ok

    async def end(self, token: str) -> bool:
        """The proxy ``token``'s cleanup: its instance's ``cleanup()`` runs, then its
        thread ends. False if it was not running."""
        with self._lock:
            run = self._runs.get(token)
        if run is None:
            return False
        run.abort_setup()  # a factory still running: the stop need not wait for it
        try:
            await self._result(run.call("stop"))
        finally:
            with self._lock:
                if self._runs.get(token) is run:
                    del self._runs[token]
            self._functions.discard(run)
            run.stop()
        return True

    def stop_all(self) -> None:
        """Stop every run (the engine closes)."""
        with self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
        for run in runs:
            run.stop()
