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
import os
import tempfile
import time
import uuid
from typing import Any, ClassVar

import ray
from ray import tune

from tune_hydra.checkpoint import discard_partial_save
from tune_hydra.tune.actor import engine_actor_name
from tune_hydra.tune.errors import EngineUnavailableError
from tune_hydra.tune.factories import FactoryStore

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
        _factory_id: the id of the task factory the executor stored in the cluster (see
            :mod:`tune_hydra.tune.factories`): only the engine actors load the factory, so
            neither its bytes nor its imports (torch ...) ever reach a trial process.
        _run_id: the executor's id (part of the engine actors' names).
    """

    _factory_id: ClassVar[str] = ""
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
                raise EngineUnavailableError(self._no_engine_message(node_id)) from None
        return self._actor

    def _no_engine_message(self, node_id: str) -> str:
        if FactoryStore(self._run_id).get(self._factory_id) is not None:
            # The experiment is live (its factory is stored): the engine died for good.
            return (
                f"the tune_hydra engine actor of this trial's node ({node_id}) is dead and "
                f"was not restarted (killed, out of memory, or its node failed); its log is "
                f"in Ray's session folder (logs/worker-*.err). Tune retries this trial from "
                f"its last checkpoint if max_failures allows; restart the experiment with "
                f"Tuner.restore(..., resume_errored=True) otherwise."
            )
        return (
            f"no tune_hydra engine actor on this trial's node ({node_id}): its "
            f"HydraExecutor was shut down (th.run returned, or its with-block ended) or "
            f"released this trainable. Run trials through th.run(...), or "
            f"executor.trainable(...) while the executor is started."
        )

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
            except ray.exceptions.ActorDiedError as err:
                node_id = ray.get_runtime_context().get_node_id()
                raise EngineUnavailableError(
                    f"the tune_hydra engine actor of this trial's node ({node_id}) died "
                    f"during its {method!r} call (killed, out of memory, or its node "
                    f"failed); its log is in Ray's session folder (logs/worker-*.err). Tune "
                    f"retries this trial from its last checkpoint if max_failures allows. "
                    f"Ray said: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
                ) from None

    def _ensure_registered(self) -> None:
        if self._key == self.trial_id:
            return
        self._deregister()
        self._num_shards = int(
            self._call("register", self.trial_id, self._token, self._factory_id, self.config)
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
        """Have the engine actor write the trial's checkpoint into ``checkpoint_dir``.

        The engine actor is on this node, so it writes the files straight into the
        directory: no model bytes pass through this process. If the save fails (the engine
        died mid-save, the disk is full ...), what it left is removed here, since a killed
        engine cannot: its temp files, and the directory itself when Tune's
        ``Trainable.save`` made it for this save in the temp folder (Ray 2.60 removes that
        directory only after a successful save).
        """
        before = set(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else set()
        try:
            self._ensure_registered()
            self._call("save", self._key, self._token, str(checkpoint_dir))
        except Exception:
            # tempfile.mkdtemp() of Trainable.save: a fresh "tmp..." folder in the temp dir
            folder, name = os.path.split(os.path.abspath(checkpoint_dir))
            made_by_tune = (
                not before
                and folder == os.path.abspath(tempfile.gettempdir())
                and name.startswith(tempfile.gettempprefix())
            )
            discard_partial_save(checkpoint_dir, keep=before, remove_dir=made_by_tune)
            raise

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
