"""Where an experiment's task factory lives: once in the cluster, never in the proxies.

A task factory often closes over data (a tokenised corpus, a dataset tensor). Carried as
a class attribute of the proxy trainable it was copied into every trial process (Tune
pickles the trainable class into each one): a factory closing over 40 MB cost +80 MiB per
trial. Instead the driver stores the pickled factory once in Ray's cluster key-value store
(the GCS, where Tune keeps its own registered trainables) under a random id; the proxies
carry only the id, and each engine actor reads the factory once, on its first trial, and
keeps it until the experiment releases it. The KV entry survives an engine actor restart
(the restarted actor reads it again); :meth:`FactoryStore.delete` frees it when the
experiment ends.
"""

from __future__ import annotations

import json
import uuid

from tune_hydra.exceptions import SystematicTaskError

_NAMESPACE = "tune_hydra"


class FactoryStore:
    """The pickled task factories of one executor (``run_id``) in Ray's cluster KV store.

    Any process connected to the cluster (driver, engine actors) can read them; only the
    id is passed around. Picklable: an engine actor receives one at creation.

    Args:
        run_id: the executor's id (keys are ``"<run_id>:<factory id>"``).
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def _key(self, factory_id: str) -> bytes:
        return f"factory:{self.run_id}:{factory_id}".encode()

    def put(self, blob: bytes) -> str:
        """Store a pickled factory; returns its new id."""
        from ray.experimental import internal_kv

        factory_id = uuid.uuid4().hex
        internal_kv._internal_kv_put(self._key(factory_id), blob, namespace=_NAMESPACE)
        return factory_id

    def get(self, factory_id: str) -> bytes | None:
        """The pickled factory, or None if it was deleted (or never stored)."""
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(self._key(factory_id), namespace=_NAMESPACE)
        return bytes(value) if value is not None else None

    def delete(self, factory_id: str) -> None:
        """Free a stored factory (idempotent)."""
        from ray.experimental import internal_kv

        if internal_kv._internal_kv_initialized():
            internal_kv._internal_kv_del(self._key(factory_id), namespace=_NAMESPACE)

    # -- systematic mistakes ------------------------------------------------------------
    # A trial that hits a mistake every trial would repeat records it here (plain JSON:
    # the driver reads it back without unpickling anything a trial process wrote).

    def _error_key(self, trial_id: str) -> bytes:
        return f"systematic:{self.run_id}:{trial_id}".encode()

    def record_error(self, trial_id: str, err: SystematicTaskError) -> None:
        """Record a trial's systematic mistake for the driver (see
        :func:`tune_hydra.frontends.ray.callback.HydraCallback`)."""
        from ray.experimental import internal_kv

        record = {
            "type": type(err).__name__,
            "trial": err.trial,
            "problem": err.problem,
            "fix": err.fix,
        }
        internal_kv._internal_kv_put(
            self._error_key(trial_id), json.dumps(record).encode(), namespace=_NAMESPACE
        )

    def recorded_error(self, trial_id: str) -> SystematicTaskError | None:
        """The mistake trial ``trial_id`` recorded, rebuilt as its own error class (one
        of the known :class:`SystematicTaskError` subclasses), or None."""
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self._error_key(trial_id), namespace=_NAMESPACE)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            args = (str(record["trial"]), str(record["problem"]), str(record["fix"]))
        except (ValueError, KeyError, TypeError):
            return None
        return _systematic_classes().get(str(record.get("type")), SystematicTaskError)(*args)

    def clear_errors(self) -> None:
        """Forget every recorded mistake of this executor (idempotent)."""
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            return
        prefix = f"systematic:{self.run_id}:".encode()
        for key in internal_kv._internal_kv_list(prefix, namespace=_NAMESPACE):
            internal_kv._internal_kv_del(key, namespace=_NAMESPACE)


def _systematic_classes() -> dict[str, type[SystematicTaskError]]:
    """Every :class:`SystematicTaskError` class by name (the errors the driver may
    rebuild from a record: a closed set, never a class a record names freely)."""
    from tune_hydra.frontends.ray.errors import (
        TrialResourcesError,  # defined there, not in exceptions
    )

    found: dict[str, type[SystematicTaskError]] = {}
    todo: list[type[SystematicTaskError]] = [SystematicTaskError, TrialResourcesError]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found


__all__ = ["FactoryStore"]
