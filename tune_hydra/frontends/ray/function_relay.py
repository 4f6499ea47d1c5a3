"""The engine actor's side of function trainables: the runs of the trials' functions in
this engine process, by trial id (see :mod:`tune_hydra.frontends.ray.function`).

A class trainable's run (:class:`~tune_hydra.frontends.ray.classes.ClassRun`, a
``FunctionRun``) is launched here too, under its trial id, so that the driver's hints,
stops and deregistrations reach it as they reach a function; its proxy's own calls go
through :class:`~tune_hydra.frontends.ray.class_relay.ClassRelay`.

This module imports neither torch nor the engine at import time (trial processes import
the actor).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tune_hydra.frontends.ray.errors import RETRY, TrialNotRegisteredError
from tune_hydra.frontends.ray.hints import NO_MILESTONE, TrialHints

if TYPE_CHECKING:
    from tune_hydra.frontends.ray.function import FunctionRun


class FunctionRelay:
    """The function runs of one engine actor: starts them, hands their reports to their
    proxies, passes the driver's hints on, and stops them.

    Args:
        hints: the actor's hints; a run gets those that came before it started.
        is_driver: whether a token is the executor's secret (its driver may reach every
            trial's run; a proxy only its own).
    """

    def __init__(self, hints: TrialHints, is_driver: Callable[[str], bool]) -> None:
        self._hints = hints
        self._is_driver = is_driver
        self._lock = threading.Lock()  # touched from two event-loop threads
        self._runs: dict[str, FunctionRun] = {}  # by trial id
        self._threads: list[FunctionRun] = []  # every run started, until its thread ends

    def start(
        self,
        fn: Any,
        config: dict[str, Any],
        *,
        key: str,
        token: str,
        engine: Any,
        context: dict[str, Any],
        seed: int | None,
    ) -> None:
        """Start trial ``key``'s function ``fn`` (``tune.with_parameters`` bound) on
        ``engine``, owned by ``token`` (see :class:`FunctionRun` for the rest)."""
        from tune_hydra.frontends.ray.function import FunctionRun

        run = FunctionRun(
            fn, dict(config), key=key, token=token, engine=engine, context=context, seed=seed
        )
        self.launch(key, run)

    def launch(self, key: str, run: FunctionRun) -> None:
        """Make ``run`` trial ``key``'s, stopping an older run of the trial (a class
        trainable's is only displaced: its proxy, which Tune may have cached, ends it),
        give it the hints that came first, and start its thread."""
        with self._lock:
            old = self._runs.get(key)
            self._runs[key] = run
        if old is not None and not old.proxy_owned:
            old.stop()
        self._give_hints(key, run)
        run.start()
        with self._lock:
            self._threads = [r for r in self._threads if r.thread.is_alive()]
            self._threads.append(run)

    def rekey(self, run: FunctionRun, old_key: str, new_key: str) -> None:
        """``run`` serves trial ``new_key`` instead of ``old_key`` from now on (Tune reset
        a class trainable's proxy for another trial), with that trial's hints."""
        with self._lock:
            if self._runs.get(old_key) is run:
                del self._runs[old_key]
            # A run displaced here (the new trial's own earlier proxy, cached by Tune)
            # keeps running for its proxy, which addresses it by token.
            self._runs[new_key] = run
            run.key = new_key
        self._give_hints(new_key, run)

    def discard(self, run: FunctionRun) -> None:
        """Forget ``run`` (its proxy ended it), if it still serves its trial."""
        with self._lock:
            if self._runs.get(run.key) is run:
                del self._runs[run.key]

    def _give_hints(self, key: str, run: FunctionRun) -> None:
        remaining, milestone = self._hints.get(key)  # hints that came before the run
        if milestone is not NO_MILESTONE:
            run.hint(milestone=milestone)
        if remaining is not None:
            run.hint(remaining=remaining)

    def hint(self, key: str, **hint: Any) -> bool:
        """Pass a hint of the driver (``remaining=`` or ``milestone=``, see
        ``FunctionRun.hint``) to trial ``key``'s run; False if none runs."""
        with self._lock:
            run = self._runs.get(key)
        if run is None:
            return False
        run.hint(**hint)
        return True

    def _owned(self, key: str, token: str) -> FunctionRun:
        with self._lock:
            run = self._runs.get(key)
        if run is None or not (run.token == token or self._is_driver(token)):
            why = "the engine does not know it" if run is None else "a newer copy took it over"
            raise TrialNotRegisteredError(
                f"trial {key!r}'s function is not running in this engine: {why} (the engine "
                f"actor restarted, or Tune restarted the trial). {RETRY}"
            )
        return run

    async def next(self, key: str, token: str, persisted: Any = None) -> tuple[str, Any, Any]:
        """Let trial ``key``'s function go on from its last report, and wait for its next
        item (see ``EngineActor.fn_next``)."""
        run = self._owned(key, token)
        return await asyncio.wrap_future(run.take(persisted))

    def stop(self, key: str, token: str, completed: bool = False) -> bool:
        """Stop trial ``key``'s run if ``token`` owns it (or is the executor's secret);
        ``completed``: the trial completed, which leaves a class trainable's run to its
        proxy. True if it was stopped."""
        with self._lock:
            run = self._runs.get(key)
            if run is None or not (run.token == token or self._is_driver(token)):
                return False
            if completed and run.proxy_owned:
                return False  # its proxy ends it (or Tune resets it for another trial)
            del self._runs[key]
        run.stop()
        return True

    def running(self) -> list[str]:
        """The trial ids with a run here (not stopped, not ended by its proxy)."""
        with self._lock:
            return sorted(self._runs)

    def alive(self) -> list[str]:
        """The trial ids whose run's thread still runs (a stopped one until it reached
        its next forward or report)."""
        with self._lock:
            return sorted(r.key for r in self._threads if r.thread.is_alive())

    def stop_all(self) -> None:
        """Stop every run (the engine closes)."""
        with self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
        for run in runs:
            run.stop()
