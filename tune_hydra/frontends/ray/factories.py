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

Ownership (Ray gives drivers of one cluster no isolation from each other: any of them can
list and read every key of the KV store): every record is bound to the experiment's
secret (:class:`~tune_hydra.HydraExecutor` makes one with :func:`secrets.token_hex`). A
factory is stored under a key derived from the secret, encrypted with a key stream derived
from it (SHAKE-256) and authenticated (HMAC-SHA256, encrypt-then-MAC), so another driver
that lists the store finds bytes it can neither unpickle nor replace; a systematic-error
record carries an HMAC tag, and one without a valid tag (planted by another driver) is
ignored with a log line.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import threading
import traceback
import types
import uuid
from collections.abc import Callable
from typing import Any

from tune_hydra.exceptions import SystematicTaskError

logger = logging.getLogger(__name__)

_NAMESPACE = "tune_hydra"
_SEALED = b"THS1"  # format tag of a sealed (encrypted and authenticated) value
_NONCE = 16
_TAG = 32


def closure(fn: Any) -> dict[str, Any]:
    """The values ``fn`` closes over, by name (empty cells left out): how the wrappers
    Tune makes (``tune.with_parameters``) keep what they wrap.

    Example:
        >>> def outer(x):
        ...     return lambda: x
        >>> closure(outer(3))
        {'x': 3}
    """
    code = getattr(fn, "__code__", None)
    cells = zip(
        code.co_freevars if code else (), getattr(fn, "__closure__", None) or (), strict=False
    )
    values: dict[str, Any] = {}
    for name, cell in cells:
        with contextlib.suppress(ValueError):  # an empty cell
            values[name] = cell.cell_contents
    return values


def _subkey(secret: str, purpose: str) -> bytes:
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).digest()


def _xor(data: bytes, stream: bytes) -> bytes:
    n = len(data)
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(n, "little")


def seal(secret: str, purpose: str, data: bytes) -> bytes:
    """``data`` encrypted and authenticated with keys derived from ``secret`` and
    ``purpose`` (the KV key it is stored under, so a sealed value cannot be moved to
    another key): a SHAKE-256 key stream over (key, random nonce), then an HMAC-SHA256
    tag over nonce and ciphertext. :func:`unseal` reverses it.

    Example:
        >>> unseal("k", "a", seal("k", "a", b"data")), unseal("x", "a", seal("k", "a", b"d"))
        (b'data', None)
    """
    nonce = os.urandom(_NONCE)
    stream = hashlib.shake_256(_subkey(secret, "enc:" + purpose) + nonce).digest(len(data))
    body = nonce + _xor(data, stream)
    tag = hmac.new(_subkey(secret, "mac:" + purpose), body, hashlib.sha256).digest()
    return _SEALED + tag + body


def unseal(secret: str, purpose: str, sealed: bytes) -> bytes | None:
    """The data :func:`seal` sealed with the same ``secret`` and ``purpose``; None for
    anything else (another key, another purpose, changed bytes)."""
    head = len(_SEALED)
    if len(sealed) < head + _TAG + _NONCE or not sealed.startswith(_SEALED):
        return None
    tag, body = sealed[head : head + _TAG], sealed[head + _TAG :]
    want = hmac.new(_subkey(secret, "mac:" + purpose), body, hashlib.sha256).digest()
    if not hmac.compare_digest(tag, want):
        return None
    nonce, data = body[:_NONCE], body[_NONCE:]
    stream = hashlib.shake_256(_subkey(secret, "enc:" + purpose) + nonce).digest(len(data))
    return _xor(data, stream)


class FactoryStore:
    """The pickled task factories of one executor (``run_id``) in Ray's cluster KV store.

    Only processes that hold the experiment's ``secret`` (its driver, its engine actors
    and its trials) can read a factory or write a record the driver believes; only the
    id is passed around. Picklable: an engine actor receives one at creation.

    Args:
        run_id: the executor's id.
        secret: the experiment's secret (keys and seals are derived from it).
    """

    def __init__(self, run_id: str, secret: str = "") -> None:
        self.run_id = run_id
        self.secret = secret

    def _key(self, factory_id: str) -> bytes:
        # Derived from the secret: the key names neither the experiment nor the factory.
        digest = hmac.new(
            self.secret.encode(), f"factory:{self.run_id}:{factory_id}".encode(), hashlib.sha256
        ).hexdigest()
        return f"factory:{digest[:40]}".encode()

    def put(self, blob: bytes) -> str:
        """Store a pickled factory (sealed); returns its new id."""
        from ray.experimental import internal_kv

        factory_id = uuid.uuid4().hex
        key = self._key(factory_id)
        sealed = seal(self.secret, key.decode(), blob)
        internal_kv._internal_kv_put(key, sealed, namespace=_NAMESPACE)
        return factory_id

    def get(self, factory_id: str) -> bytes | None:
        """The pickled factory, or None if it was deleted (or never stored).

        Raises:
            TaskFactoryError: the stored value does not unseal with this experiment's
                secret (another driver replaced it); it is never unpickled.
        """
        from ray.experimental import internal_kv

        from tune_hydra.exceptions import TaskFactoryError

        key = self._key(factory_id)
        value = internal_kv._internal_kv_get(key, namespace=_NAMESPACE)
        if value is None:
            return None
        blob = unseal(self.secret, key.decode(), bytes(value))
        if blob is None:
            raise TaskFactoryError(
                f"the stored task factory {factory_id[:8]} of experiment {self.run_id} is "
                f"not sealed with the experiment's key: something else on the cluster "
                f"replaced it in Ray's key-value store, so it was not unpickled. Nothing of "
                f"it ran; restart the experiment (a new HydraExecutor stores it afresh)"
            )
        return blob

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
        record["tag"] = self._tag(trial_id, record)
        internal_kv._internal_kv_put(
            self._error_key(trial_id), json.dumps(record).encode(), namespace=_NAMESPACE
        )

    def _tag(self, trial_id: str, record: dict[str, str]) -> str:
        """HMAC-SHA256 of a record's fields and key, with the experiment's secret."""
        fields = {k: str(record.get(k)) for k in ("type", "trial", "problem", "fix")}
        text = json.dumps([self._error_key(trial_id).decode(), fields], sort_keys=True)
        return hmac.new(self.secret.encode(), text.encode(), hashlib.sha256).hexdigest()

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
            tag = str(record.get("tag", ""))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None
        if not self.secret or not hmac.compare_digest(tag, self._tag(trial_id, record)):
            logger.warning(
                "tune_hydra: ignoring a systematic-error record for trial %s of experiment "
                "%s that does not carry the experiment's key (written by another driver?)",
                trial_id,
                self.run_id,
            )
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


class BoundFactory:
    """A task factory with keyword arguments bound to it, as ``tune.with_parameters``
    binds them: calling it with a config calls ``fn(config, **parameters)``.

    Parameters that are Ray ``ObjectRef``s (what ``tune.with_parameters`` keeps in Ray's
    object store) are fetched on the first call, in the calling thread, and the values
    are kept for the next calls: one copy per engine process, shared by the trials it
    builds (as the data a factory closes over is), none in the trial processes. Pickling
    keeps the references, never the fetched values.

    Args:
        fn: the user's task factory, ``fn(config, **parameters) -> ModelTask``.
        parameters: keyword name -> ``ObjectRef`` or value.
    """

    def __init__(self, fn: Callable[..., Any], parameters: dict[str, Any]) -> None:
        self.fn = fn
        self.parameters = dict(parameters)
        self._values: dict[str, Any] | None = None
        self._lock = threading.Lock()

    @property
    def __name__(self) -> str:  # names the factory in errors
        return str(getattr(self.fn, "__name__", "make_task"))

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": self.fn, "parameters": self.parameters}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["fn"], state["parameters"])  # type: ignore[misc]

    def values(self) -> dict[str, Any]:
        """The parameters' values (fetched from the object store once)."""
        import ray

        with self._lock:
            if self._values is None:
                refs = {k: v for k, v in self.parameters.items() if isinstance(v, ray.ObjectRef)}
                fetched = dict(zip(refs, ray.get(list(refs.values())), strict=True))
                self._values = {k: fetched.get(k, v) for k, v in self.parameters.items()}
            return self._values

    def __call__(self, config: Any) -> Any:
        return self.fn(config, **self.values())

    def __repr__(self) -> str:
        return f"BoundFactory({self.__name__}, {sorted(self.parameters)})"


def unwrap_with_parameters(fn: Any) -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """``(make_task, parameters)`` when ``fn`` is what ``tune.with_parameters(make_task,
    **parameters)`` returns for a function, else None.

    Tune's wrapper fetches every parameter from the object store at each call; the engine
    calls ``make_task(config, **parameters)`` itself instead (through a
    :class:`BoundFactory`, which fetches them once per engine).
    A parameter is an ``ObjectRef`` once Ray is up, else the value Tune holds until then.
    """
    if not isinstance(fn, types.FunctionType) or not fn.__module__.startswith("ray."):
        return None
    cells = closure(fn)
    from ray.tune.registry import _ParameterRegistry

    params_registry, prefix = cells.get("parameter_registry"), cells.get("prefix")
    keys, inner = cells.get("keys"), cells.get("trainable")
    if (
        not isinstance(params_registry, _ParameterRegistry)
        or not isinstance(prefix, str)
        or not isinstance(keys, (set, frozenset, list, tuple))
        or not callable(inner)
    ):
        return None
    params: dict[str, Any] = {}
    for key in keys:
        ref = params_registry.references.get(prefix + str(key))
        if ref is None and prefix + str(key) not in params_registry.to_flush:
            return None
        params[str(key)] = ref if ref is not None else params_registry.to_flush[prefix + str(key)]
    return inner, params


class RunFactories:
    """The task factories one executor stored for its experiments, from ``put`` to their
    release in the cluster store and in every engine.

    Args:
        store: the executor's :class:`FactoryStore`.
        release_in_engines: makes every engine forget a factory id (a callable, so this
            module needs nothing of the engine fleet).
    """

    def __init__(self, store: FactoryStore, release_in_engines: Callable[[str], None]) -> None:
        self._store = store
        self._release_in_engines = release_in_engines
        self.ids: list[str] = []

    def put(self, make_task: Callable[..., Any]) -> str:
        """Store ``make_task`` (``tune.with_parameters`` unwrapped into a
        :class:`BoundFactory`) once in the cluster; returns the id the trials carry."""
        import ray

        unwrapped = unwrap_with_parameters(make_task)
        factory: Any = make_task if unwrapped is None else BoundFactory(*unwrapped)
        factory_id = self._store.put(ray.cloudpickle.dumps(factory))
        self.ids.append(factory_id)
        return factory_id

    def drop(self, factory_id: str) -> None:
        """Free a factory in every engine and in the cluster (idempotent)."""
        if factory_id in self.ids:
            self.ids.remove(factory_id)
        self._release_in_engines(factory_id)
        try:
            self._store.delete(factory_id)
        except Exception:
            logger.warning("tune_hydra: could not free a task factory", exc_info=True)

    def drop_all(self) -> None:
        """Free every factory still held (the executor shuts down)."""
        for factory_id in list(self.ids):
            self.drop(factory_id)


class FactoryCache:
    """An engine's copies of its experiments' task factories: each read from the store
    on its first trial and kept until the experiment releases it (one copy per engine,
    none in the trial processes), and bound to each set of ``tune.with_parameters``
    references once (so their data is fetched once per engine).

    Args:
        store: a :class:`FactoryStore`, or a ``{id: blob}`` dict when hosted without Ray.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._factories: dict[str, Callable[..., Any]] = {}
        self._bound: dict[str, dict[tuple[tuple[str, str], ...], BoundFactory]] = {}

    def get(self, factory_id: str) -> Callable[..., Any]:
        """The factory (blocking: it may read the store and unpickle).

        Raises:
            TaskFactoryError: the experiment released it, or it does not unpickle here.
        """
        from tune_hydra.exceptions import TaskFactoryError

        with self._lock:
            fn = self._factories.get(factory_id)
        if fn is not None:
            return fn
        blob = self._store.get(factory_id)
        if blob is None:
            raise TaskFactoryError(
                f"the task factory {factory_id[:8]} is not available: its experiment ended "
                f"(th.run returned, or the HydraExecutor was shut down) and released it. Get "
                f"a new trainable with executor.trainable(make_task) for a new experiment"
            )
        try:
            import ray

            fn = ray.cloudpickle.loads(blob)
        except Exception:
            raise TaskFactoryError(
                f"the task factory could not be unpickled in the engine's process; install "
                f"what it imports on every engine node. Traceback:\n{traceback.format_exc()}"
            ) from None
        with self._lock:
            return self._factories.setdefault(factory_id, fn)

    def bind(self, factory_id: str, params: dict[str, Any]) -> Callable[..., Any]:
        """The factory with a trial's ``tune.with_parameters`` parameters: object
        references are fetched once per engine (the bound factory is kept until the
        release); plain values come with every registration."""
        import ray

        factory = self.get(factory_id)
        if not params:
            return factory
        if not all(isinstance(v, ray.ObjectRef) for v in params.values()):
            return BoundFactory(factory, params)
        key = tuple(sorted((k, v.hex()) for k, v in params.items()))
        with self._lock:
            bound = self._bound.setdefault(factory_id, {})
            return bound.setdefault(key, BoundFactory(factory, params))

    def release(self, factory_id: str) -> None:
        """Forget an experiment's factory (it ended)."""
        with self._lock:
            self._factories.pop(factory_id, None)
            self._bound.pop(factory_id, None)


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


__all__ = ["BoundFactory", "FactoryCache", "FactoryStore", "closure", "seal", "unseal"]
