"""The proxy :class:`~ray.tune.Trainable` that Tune runs for each trial.

It holds no model: every call is forwarded to the engine actor of its node, which trains
all trials of that node together. The module must not import torch (directly or through the
engine): each trial is a Ray worker process, and torch would triple its memory.

Registration with the engine is *lazy* (first ``step`` or ``load_checkpoint``) and carries
an ownership token: with PBT and ``reuse_actors=True`` Tune may build an extra actor for a
trial and throw it away, and an eager ``setup``/``cleanup`` pair would clobber the live
trial's registration. ``reset()`` changes ``trial_id`` before ``reset_config`` runs, so the
key we registered under is remembered separately.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, ClassVar

import ray
from ray import tune

from tune_hydra.tune.actor import engine_actor_name
from tune_hydra.tune.errors import EngineUnavailableError

RESULT_KEYS = (
    "loss",
    "val_loss",
    "num_shards",
    "epoch",
    "batches",
    "device_time_s",
    "bytes_spilled",
)
"""Engine metrics copied into each Tune result."""

_CONTROL_RETRY_S = 60.0  # how long a control call waits for a restarting engine actor


class HydraTrainable(tune.Trainable):
    """Proxy trainable; :meth:`HydraExecutor.trainable` makes a subclass per task factory.

    Class attributes (set on the subclass):
        _factory_blob: the task factory, cloudpickled on the driver. It is only unpickled in
            the engine actor, so the factory's imports (torch ...) never load here.
        _run_id: the executor's id (part of the engine actors' names).
    """

    _factory_blob: ClassVar[bytes] = b""
    _run_id: ClassVar[str] = ""

    def setup(self, config: dict[str, Any]) -> None:
        self._token = uuid.uuid4().hex
        self._key: str | None = None  # the trial id we are registered under
        self._actor: Any = None
        self._num_shards: int | None = None

    # ---------------------------------------------------------------- plumbing
    def _engine(self) -> Any:
        if self._actor is None:
            node_id = ray.get_runtime_context().get_node_id()
            name = engine_actor_name(self._run_id, node_id)
            try:
                self._actor = ray.get_actor(name)
            except ValueError:
                raise EngineUnavailableError(
                    f"no tune_hydra engine actor on this trial's node ({node_id}): the "
                    f"HydraExecutor was shut down, or the node lacks the slot resource the "
                    f"executor's trials ask for. Run trials through th.run(...) or "
                    f"executor.trainable(...) while the executor is started."
                ) from None
        return self._actor

    def _call(self, method: str, *args: Any, retry: bool = True) -> Any:
        """Call an engine-actor method and wait; control calls wait out an actor restart."""
        deadline = time.monotonic() + _CONTROL_RETRY_S
        while True:
            try:
                return ray.get(getattr(self._engine(), method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if not retry or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _ensure_registered(self) -> None:
        if self._key == self.trial_id:
            return
        self._deregister()
        self._num_shards = int(
            self._call("register", self.trial_id, self._token, self._factory_blob, self.config)
        )
        self._key = self.trial_id

    def _deregister(self) -> None:
        key, self._key = self._key, None
        if key is not None and self._actor is not None:
            # If the engine is gone or restarted, there is nothing left to free there.
            with contextlib.suppress(Exception):
                self._call("deregister", key, self._token, retry=False)

    # ------------------------------------------------------------ Trainable API
    def step(self) -> dict[str, Any]:
        self._ensure_registered()
        # No retry: if the engine restarted mid-iteration, the trial's state there is gone
        # and Tune must restore it from its checkpoint.
        results = self._call("train", self._key, self._token, 1, retry=False)
        last = results[-1]
        out = {k: last[k] for k in RESULT_KEYS if k in last}
        out.setdefault("num_shards", self._num_shards)
        return out

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        # The engine actor is on this node, so it writes model.pt etc. straight into the
        # directory: no model bytes pass through this process.
        self._ensure_registered()
        self._call("save", self._key, self._token, str(checkpoint_dir))

    def load_checkpoint(self, checkpoint: Any) -> None:
        self._ensure_registered()
        self._call("load", self._key, self._token, str(checkpoint))

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        # Called by Trainable.reset after trial_id already changed: drop the old key's
        # registration now; the new trial registers lazily.
        self._deregister()
        self.config = new_config
        return True

    def cleanup(self) -> None:
        self._deregister()
