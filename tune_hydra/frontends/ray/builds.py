"""The task factories an engine actor is waiting for, and how to stop waiting.

A trial's factory runs in a thread of its own (``tune_hydra.engine.registration.factory``);
the engine actor awaits it at most ``factory_timeout_s``, or until the trial is stopped:
Tune stops or pauses it (its proxy's ``cancel``), or the driver is interrupted
(``abort_builds``).
Nothing of ours waits with a factory that hangs: it costs only its own thread.

This module imports neither torch nor Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
from typing import Any

from tune_hydra.exceptions import TaskFactoryTimeoutError
from tune_hydra.frontends.ray.errors import EngineUnavailableError, TrialNotRegisteredError


class PendingBuilds:
    """The trials of one engine actor whose task factory is running, each with its
    owner's token and a future that ends the wait. Touched only from the event loop of
    the actor's control group (no lock).

    Args:
        secret: the experiment's secret (its driver may stop any trial's wait).
    """

    def __init__(self, secret: str = "") -> None:
        self._secret = secret
        self._waiting: dict[str, tuple[str, asyncio.Future[None]]] = {}

    async def wait(
        self,
        key: str,
        token: str,
        future: concurrent.futures.Future[Any],
        *,
        timeout_s: float | None,
        what: str,
    ) -> Any:
        """What the factory's ``future`` gives, waiting at most ``timeout_s`` or until
        :meth:`abort` (a late result is then dropped).

        Raises:
            TaskFactoryError: the factory raised.
            TaskFactoryTimeoutError: it did not return within ``timeout_s``.
            EngineUnavailableError: the trial was stopped while its factory ran.
        """
        result = asyncio.wrap_future(future)
        abort = asyncio.get_running_loop().create_future()
        self._waiting[key] = (token, abort)
        try:
            done, _ = await asyncio.wait(
                {result, abort}, timeout=timeout_s, return_when="FIRST_COMPLETED"
            )
        finally:
            if self._waiting.get(key, (None, None))[1] is abort:
                del self._waiting[key]
        if result in done:
            return result.result()
        future.cancel()  # a late result is dropped
        if abort in done:
            raise EngineUnavailableError(
                f"trial {key!r} was stopped while its task factory was still running (Tune "
                f"stopped or paused it, or the experiment was interrupted)"
            )
        raise TaskFactoryTimeoutError(what, float(timeout_s or 0.0))

    def abort(self, key: str, token: str) -> None:
        """Stop waiting for trial ``key``'s factory (its owner or the driver asks)."""
        waiting = self._waiting.get(key)
        if waiting is None:
            return
        owner, abort = waiting
        is_driver = bool(self._secret) and hmac.compare_digest(str(token), self._secret)
        if token != owner and not is_driver:
            raise TrialNotRegisteredError(
                f"trial {key!r} is being registered by someone else; only its owner or "
                f"its experiment's driver can stop it"
            )
        if not abort.done():
            abort.set_result(None)

    def abort_all(self) -> int:
        """Stop waiting for every factory (the driver was interrupted); returns how many."""
        keys = list(self._waiting)
        for key in keys:
            self.abort(key, self._secret)
        return len(keys)


__all__ = ["PendingBuilds"]
