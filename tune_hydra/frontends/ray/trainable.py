"""The proxy :class:`~ray.tune.Trainable` that Tune runs for each trial of a task factory.

A task factory's trial is a class trainable whose class is canned
(:class:`~tune_hydra.frontends.ray.task_trainable.TaskTrainable`, in the engine process):
its proxy is a :class:`~tune_hydra.frontends.ray.classes.HydraClassTrainable` with the
checkpoint guards of a folder tune_hydra writes (nothing else is read, and Ray never
unpickles what a folder holds), a failed save's leftovers removed, and the process kept
for the next trial (nothing of the user's runs in it).

The module must not import torch (directly or through the engine): each trial is a Ray
worker process, and torch would triple its memory.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, ClassVar

from ray import tune

from tune_hydra.frontends.checkpoint import (
    check_checkpoint_files,
    discard_partial_save,
    not_a_folder,
)
from tune_hydra.frontends.ray.classes import HydraClassTrainable


def _checkpoint_listing(checkpoint: Any) -> tuple[str, list[str]] | None:
    """``(folder, names of its entries)`` of what Ray's ``Trainable.restore`` is given (a
    path, a ``tune.Checkpoint`` or a training result holding one), listed on the
    checkpoint's own file system (local, NFS, cloud); None when there is nothing to list
    (Ray then raises its own error)."""
    ckpt = checkpoint if isinstance(checkpoint, tune.Checkpoint) else None
    if ckpt is None and isinstance(checkpoint, (str, os.PathLike)):
        path = os.fspath(checkpoint)
        return (path, os.listdir(path)) if os.path.isdir(path) else None
    if ckpt is None:
        ckpt = getattr(checkpoint, "checkpoint", None)
    if not isinstance(ckpt, tune.Checkpoint):
        return None
    import pyarrow.fs

    fs = ckpt.filesystem
    if fs is None:
        return None
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(ckpt.path))
    except (FileNotFoundError, OSError):
        return None  # gone: Ray says so
    return ckpt.path, [info.base_name for info in infos]


class HydraTrainable(HydraClassTrainable):
    """Proxy of a task factory's trials; :meth:`HydraExecutor.trainable` makes a subclass
    per factory (:meth:`for_factory`).

    Class attributes (set on the subclass), beside :class:`HydraClassTrainable`'s:
        _checkpoint: ``"every"`` asks Tune for a checkpoint after every iteration (the
            ``should_checkpoint`` result); ``"end"`` and None leave it to the run (the
            executor's callback asks for the last one with ``"end"``).
        _required_metrics: metric names of the run (its ``metric``, its scheduler's or
            search algorithm's) that only a task's ``metrics`` can give; a trial whose
            task does not declare them fails with the systematic
            :class:`~tune_hydra.exceptions.UndeclaredMetricError` (set by ``th.run``).
    """

    _checkpoint: ClassVar[str | None] = None
    _reuse_process: ClassVar[bool] = True  # see EngineClient: nothing of the user's here
    _has_reset_config: ClassVar[bool] = True  # the canned class builds the next trial's task

    @classmethod
    def for_factory(
        cls,
        name: str,
        *,
        factory_id: str,
        run_id: str,
        secret: str,
        slot_resource: str,
        checkpoint: str | None,
    ) -> type[HydraTrainable]:
        """The proxy class of one stored task factory (see the class attributes)."""
        return type(
            f"Hydra_{name}",
            (cls,),
            {
                "_name": name,
                "_factory_id": factory_id,
                "_run_id": run_id,
                "_secret": secret,
                "_slot_resource": slot_resource,
                "_checkpoint": checkpoint,
                "__module__": cls.__module__,
            },
        )

    def _context(self) -> dict[str, Any]:
        """The class run's context, with what the canned class checks and asks of Tune."""
        return {
            **super()._context(),
            "task": {"required": list(self._required_metrics), "checkpoint": self._checkpoint},
        }

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Have the trial's instance write its checkpoint into ``checkpoint_dir``.

        The engine actor is on this node, so it writes the files straight into the
        directory: no model bytes pass through this process. If the save fails (the engine
        died mid-save, the disk is full ...), what it left is removed here, since a killed
        engine cannot: its temp files, and the directory itself when Tune's
        ``Trainable.save`` made it for this save in the temp folder (Ray 2.60 removes that
        directory only after a successful save).
        """
        before = set(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else set()
        try:
            super().save_checkpoint(str(checkpoint_dir))
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

    def restore(self, checkpoint_path: Any) -> None:
        """Refuse a checkpoint folder holding anything tune_hydra does not write, then
        let Ray's ``Trainable.restore`` go on (it calls :meth:`load_checkpoint`).

        The check runs first because Ray's ``restore`` unpickles ``_dict_checkpoint.pkl``
        whenever a checkpoint folder holds one, in this process, before
        ``load_checkpoint``: a payload planted there would run (``Tuner.restore``,
        ``th.run(resume=...)``, retries after a failure, PBT exploits). tune_hydra never
        writes that file.

        Raises:
            ForeignCheckpointFileError: the folder holds a name that no tune_hydra
                checkpoint holds (see :func:`~tune_hydra.frontends.checkpoint.
                check_checkpoint_files`); nothing in it was read.
        """
        listed = _checkpoint_listing(checkpoint_path)
        if listed is not None:
            check_checkpoint_files(*listed)
        super().restore(checkpoint_path)

    def load_checkpoint(self, checkpoint: Any) -> None:
        if isinstance(checkpoint, tune.Checkpoint) or not isinstance(
            checkpoint, (str, os.PathLike)
        ):
            raise not_a_folder(checkpoint)
        check_checkpoint_files(checkpoint, os.listdir(checkpoint))
        super().load_checkpoint(str(checkpoint))


__all__ = ["HydraTrainable"]
