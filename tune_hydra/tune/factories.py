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

import uuid

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


__all__ = ["FactoryStore"]
