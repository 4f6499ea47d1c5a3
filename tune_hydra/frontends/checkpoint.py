"""A trial's checkpoint: what its directory holds, how it is written and verified before
anything in it is loaded, and how a trial of an engine is saved into it and restored from
it (:func:`save_trial`, :func:`restore_trial`; :func:`save_model` writes the model file
alone). The one owner of the checkpoint schema: no other module reads or writes its file
names or manifest fields, for every front end.

A checkpoint directory holds three files:

- ``model.pt`` (:data:`MODEL_FILE`): the whole model's ``state_dict`` with the user's keys,
  so ``model.load_state_dict(torch.load(path))`` works outside tune_hydra.
- ``hydra_state.pt`` (:data:`STATE_FILE`): everything else needed to resume exactly
  (optimizer states, gradients, RNG states, epoch, iteration), tensors and plain containers
  only.
- ``hydra_meta.json`` (:data:`META_FILE`): the *manifest*, written last. It records the
  iteration, epoch, trial, shard plan, a digest of the trial's Tune config and, for each
  file, its size and SHA-256. A directory without it is an interrupted save.

Writes are atomic per file (a temp name in the same folder, flushed and fsynced, then
``os.replace``); :func:`read_checkpoint` checks the manifest and every file's digest
before it loads anything, and loads with ``torch.load(..., weights_only=True)``, so a
stale, truncated, foreign or planted file raises :class:`~tune_hydra.exceptions.CheckpointError`
instead of loading or running code.

This module imports neither torch nor Ray at import time: the Tune proxy trainable uses it
(to clean up after an interrupted save) and must stay light. torch is imported inside the
functions that read or write ``.pt`` files.

Example:
    >>> from tune_hydra.frontends.checkpoint import config_digest
    >>> config_digest({"lr": 0.1, "width": 16}) == config_digest({"width": 16, "lr": 0.1})
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tune_hydra.exceptions import CheckpointError, ForeignCheckpointFileError

logger = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
"""The whole model's ``state_dict`` (user's keys): ``model.load_state_dict(torch.load(p))``."""
STATE_FILE = "hydra_state.pt"
"""Everything else needed to resume exactly: optimizer states, RNG, epoch, iteration."""
META_FILE = "hydra_meta.json"
"""The manifest: iteration, epoch, trial, shard plan, config digest, each file's digest."""
FORMAT = 2
"""The manifest format :func:`write_checkpoint` writes."""

_DATA_FILES = (MODEL_FILE, STATE_FILE)
CHECKPOINT_FILES = frozenset({*_DATA_FILES, META_FILE})
"""Every name a tune_hydra checkpoint folder holds; anything else there is refused."""
_CHUNK = 1 << 20
_MAX_MANIFEST_BYTES = 64 << 20  # a manifest of 100k shards' layer names is far smaller
_MAX_MANIFEST_DEPTH = 8  # ours nests 3 deep (files -> name -> digest; shards -> shard -> name)
_TEMP_RE = re.compile(
    r"^\.(?:" + "|".join(re.escape(n) for n in (*_DATA_FILES, META_FILE)) + r")\.tmp-[0-9a-f]{32}$"
)
_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_UNPICKLER_RE = re.compile(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", re.S)
_LEGACY_CONFIG_KEY = "_tune_config"  # format 1 kept the whole Tune config in STATE_FILE
_RESTORE_FIX = f"{CheckpointError.RESTORE_FIX}; never copy files between checkpoint folders"
_DAMAGED = "the checkpoint is damaged or was tampered with"
_TAMPERED = f"no save writes that, so {_DAMAGED}"


# ------------------------------------------------------------------------------ helpers
def temp_name(name: str) -> str:
    """The temp name a file of the checkpoint is written under before it is renamed.

    Args:
        name: one of :data:`MODEL_FILE`, :data:`STATE_FILE`, :data:`META_FILE`.

    Returns:
        ``.<name>.tmp-<32 hex digits>``, unique per call.
    """
    return f".{name}.tmp-{uuid.uuid4().hex}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (a file name, no folder) is a temp name of :func:`temp_name`.

    Example:
        >>> is_temp_name(temp_name("model.pt")), is_temp_name("model.pt")
        (True, False)
    """
    return bool(_TEMP_RE.match(name))


def _canonical(obj: Any) -> Any:
    """``obj`` as JSON-ready data with a stable form: mappings with string keys (a key
    that is not a string is tagged with its type, so ``1`` and ``"1"`` stay apart), tuples
    and sets as lists, anything else as its ``repr`` without memory addresses."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, Mapping):
        return {
            k if isinstance(k, str) else f"<{type(k).__name__}>{_canonical(k)}": _canonical(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [_canonical(v) for v in obj]
    if isinstance(obj, set | frozenset):
        return sorted((_canonical(v) for v in obj), key=repr)
    return _ADDRESS_RE.sub("", repr(obj))


def config_digest(config: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a canonical JSON form of a trial's config.

    Keys are sorted, so key order does not matter; values JSON cannot hold (functions,
    objects) count by their ``repr`` with any ``at 0x...`` address removed, so the same
    config gives the same digest in every process.

    Args:
        config: the trial's Tune config.

    Returns:
        64 hex digits.
    """
    text = json.dumps(
        _canonical(config), sort_keys=True, separators=(",", ":"), default=repr, allow_nan=True
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _file_digest(path: Path) -> tuple[int, str]:
    """``(size in bytes, sha256 hex)`` of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _fsync_dir(path: Path) -> None:
    """Make the renames in ``path`` durable (best effort: not every filesystem can)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ------------------------------------------------------------------------------- writing
def write_checkpoint(
    path: str | os.PathLike[str],
    model_state: Mapping[str, Any],
    state: Mapping[str, Any],
    *,
    trial_id: str | None = None,
    config: Mapping[str, Any] | None = None,
    shards: Sequence[Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Write a checkpoint into directory ``path`` atomically, manifest last.

    Each file goes to a temp name in ``path`` (see :func:`temp_name`), is flushed and
    fsynced, and is then renamed into place with ``os.replace``; the manifest follows the
    data files. An existing manifest is removed first, so a save that dies half way leaves
    a directory that :func:`read_checkpoint` rejects as interrupted, never a mix. On any
    error the temp files are removed.

    Args:
        path: the checkpoint directory (created if missing).
        model_state: the model's ``state_dict``.
        state: the rest of the resume state (``TaskLoop.state()`` without ``"model"``):
            tensors and plain containers only, so that it loads with ``weights_only=True``.
            Its ``iteration``, ``epoch`` and ``num_shards`` go into the manifest.
        trial_id: the Tune trial id, for the manifest.
        config: the trial's Tune config; only its :func:`config_digest` is stored (a
            restore compares digests to tell a PBT exploit, which brings a mutated config,
            from a plain resume).
        shards: the layer names of each shard, in order (the shard plan). A record of how
            the model was cut: the state keeps optimizer state per parameter, so a restore
            under another plan (another ``device_memory``) re-shards it.

    Returns:
        The manifest that was written.

    Raises:
        CheckpointError: a file could not be written (disk full, permissions, an object
            torch cannot save); the directory then holds no new manifest.
    """
    import torch

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        # From here until the new manifest lands, the directory reads as interrupted.
        (out / META_FILE).unlink(missing_ok=True)
    except OSError as err:
        raise CheckpointError(
            str(out), None, f"cannot be prepared for writing ({err})",
            "Check that the folder is writable and the disk has room",
        ) from err  # fmt: skip
    temps: list[Path] = []
    current = META_FILE
    try:
        files: dict[str, dict[str, Any]] = {}
        staged: list[tuple[Path, str]] = []
        for name, obj in ((MODEL_FILE, dict(model_state)), (STATE_FILE, dict(state))):
            current = name
            tmp = out / temp_name(name)
            temps.append(tmp)
            with tmp.open("xb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            size, digest = _file_digest(tmp)
            files[name] = {"bytes": size, "sha256": digest}
            staged.append((tmp, name))
        current = META_FILE
        plan = [list(s) for s in shards] if shards is not None else None
        num_shards = _as_int(state.get("num_shards"))
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "writer": "tune_hydra",
            "trial_id": trial_id,
            "iteration": _as_int(state.get("iteration")),
            "epoch": _as_int(state.get("epoch")),
            "num_shards": num_shards if num_shards is not None else (len(plan) if plan else None),
            "shards": plan,
            "config_digest": None if config is None else config_digest(config),
            "torch_version": str(torch.__version__),
            "files": files,
        }
        for tmp, name in staged:
            current = name
            os.replace(tmp, out / name)
        current = META_FILE
        tmp = out / temp_name(META_FILE)
        temps.append(tmp)
        with tmp.open("x", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out / META_FILE)
        _fsync_dir(out)
        return manifest
    except Exception as err:
        raise CheckpointError(
            str(out), current, f"could not be written ({type(err).__name__}: {err})",
            "Check free disk space and permissions of the checkpoint folder; the checkpoint "
            "is incomplete and will not be restored",
        ) from err  # fmt: skip
    finally:
        for tmp in temps:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def discard_partial_save(
    path: str | os.PathLike[str], keep: Collection[str] = (), *, remove_dir: bool = False
) -> list[str]:
    """Remove what an interrupted :func:`write_checkpoint` left in ``path``.

    A save whose process was killed cannot remove its own temp files; the process that
    asked for the save (Tune's trial) calls this when the save failed.

    Args:
        path: the checkpoint directory of the failed save.
        keep: names that were in ``path`` before the save began. Temp names are always
            removed; the checkpoint's own files (``model.pt`` ...) only if not in ``keep``;
            anything else is left alone.
        remove_dir: also remove ``path`` itself with everything in it (for a directory
            made for this save only, such as the temp folder Tune's ``Trainable.save``
            creates).

    Returns:
        The names removed from ``path`` (and ``path`` itself, last, when it was removed).
    """
    root = Path(path)
    if not root.is_dir():
        return []
    removed: list[str] = []
    ours = {*_DATA_FILES, META_FILE}
    for entry in sorted(os.listdir(root)):
        if is_temp_name(entry) or (entry in ours and entry not in keep):
            with contextlib.suppress(FileNotFoundError):
                (root / entry).unlink()
                removed.append(entry)
    if remove_dir:
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            removed.append(str(root))
    return removed


# ------------------------------------------------------------------------------- reading
def check_checkpoint_files(path: str | os.PathLike[str], names: Collection[str]) -> None:
    """Refuse a checkpoint folder that holds anything tune_hydra does not write.

    tune_hydra writes only :data:`MODEL_FILE`, :data:`STATE_FILE` and :data:`META_FILE`.
    Anything else in the folder was put there by someone else, and one name matters
    above all: Ray's ``Trainable.restore`` unpickles ``_dict_checkpoint.pkl`` when a
    checkpoint folder holds one, in the trial process, before tune_hydra's
    ``load_checkpoint`` runs, so a payload planted there would run. The Tune proxy calls
    this on the folder's listing before Ray reads it; :func:`verify_checkpoint` calls it
    too.

    Args:
        path: the checkpoint folder (for the message).
        names: the names of the entries the folder holds (files and folders).

    Raises:
        ForeignCheckpointFileError: an entry that is not one of those three; nothing in
            the folder was read.

    Example:
        >>> check_checkpoint_files("ckpt", ["model.pt", "hydra_state.pt", "hydra_meta.json"])
        >>> check_checkpoint_files("ckpt", ["model.pt", "_dict_checkpoint.pkl"])
        Traceback (most recent call last):
        ...
        tune_hydra.exceptions.ForeignCheckpointFileError: checkpoint ckpt: _dict_checkpoint.pkl ...
    """
    foreign = sorted(n for n in names if n not in CHECKPOINT_FILES)
    if not foreign:
        return
    pickled = [n for n in foreign if n.endswith((".pkl", ".pickle"))]
    first = pickled[0] if pickled else foreign[0]
    others = [n for n in foreign if n != first]
    ray_pickle = (
        " (Ray's Trainable.restore would unpickle it, running any code planted in it)"
        if first == "_dict_checkpoint.pkl"
        else ""
    )
    also = f"; the folder also holds {others[:5]}" if others else ""
    raise ForeignCheckpointFileError(
        str(path),
        first,
        f"is not a file tune_hydra writes{ray_pickle}: a tune_hydra checkpoint holds only "
        f"{MODEL_FILE}, {STATE_FILE} and {META_FILE}{also}. Nothing in the folder was read",
        "If you put the file there yourself, move it out of the checkpoint folder; "
        "otherwise the folder was tampered with: delete it and restore the trial from an "
        "earlier checkpoint (or start it afresh)",
    )


def _nesting_depth(text: str, limit: int) -> int:
    """How deep JSON ``text`` nests arrays and objects, counted up to ``limit + 1`` (a
    scan that never recurses, so a hostile manifest cannot exhaust the stack)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_manifest_fields(root: Path, manifest: Mapping[str, Any]) -> None:
    """The types of the manifest fields tune_hydra reads (what a save writes)."""

    def refuse(field: str, what: str) -> CheckpointError:
        return CheckpointError(
            str(root), META_FILE,
            f"holds {field} {_short(manifest.get(field))}, not {what}: {_TAMPERED}",
            _RESTORE_FIX,
        )  # fmt: skip

    for field in ("iteration", "epoch", "num_shards"):
        value = manifest.get(field)
        if value is not None and (not _is_int(value) or value < 0):
            raise refuse(field, "a whole number >= 0")
    for field in ("trial_id", "config_digest"):
        value = manifest.get(field)
        if value is not None and not isinstance(value, str):
            raise refuse(field, "a string")
    shards = manifest.get("shards")
    if shards is not None and not (
        isinstance(shards, list)
        and all(isinstance(s, list) and all(isinstance(n, str) for n in s) for s in shards)
    ):
        raise refuse("shards", "a list of lists of layer names")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _manifest(root: Path) -> dict[str, Any]:
    meta = root / META_FILE
    if not root.is_dir():
        raise CheckpointError(
            str(root), None, "does not exist or is not a directory",
            "Pass the checkpoint directory Tune wrote (checkpoint_000NNN)",
        )  # fmt: skip
    if not meta.is_file():
        present = sorted(n for n in os.listdir(root) if not n.startswith("."))
        raise CheckpointError(
            str(root), META_FILE,
            f"is missing (the folder holds {present or 'nothing'}): the save that wrote "
            f"this checkpoint was interrupted, or the folder is not a tune_hydra checkpoint",
            _RESTORE_FIX,
        )  # fmt: skip
    try:
        size = meta.stat().st_size
        if size > _MAX_MANIFEST_BYTES:
            raise CheckpointError(
                str(root), META_FILE,
                f"has {size} bytes, far more than any manifest tune_hydra writes: {_DAMAGED}",
                _RESTORE_FIX,
            )  # fmt: skip
        text = meta.read_text(encoding="utf-8")
        if _nesting_depth(text, _MAX_MANIFEST_DEPTH) > _MAX_MANIFEST_DEPTH:
            raise CheckpointError(
                str(root), META_FILE,
                f"nests arrays or objects more than {_MAX_MANIFEST_DEPTH} deep, which no "
                f"manifest tune_hydra writes does: {_DAMAGED}", _RESTORE_FIX,
            )  # fmt: skip
        manifest = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(
            str(root), META_FILE, f"is not a readable manifest ({type(err).__name__}: "
            f"{_short(str(err))})", _RESTORE_FIX,
        ) from None  # fmt: skip
    if not isinstance(manifest, dict):
        raise CheckpointError(
            str(root), META_FILE,
            f"holds a {type(manifest).__name__}, not a tune_hydra manifest", _RESTORE_FIX,
        )  # fmt: skip
    return manifest


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a checkpoint's manifest and its files' sizes and digests, loading nothing.

    Needs no torch. A format-1 manifest (tune_hydra before digests) has nothing to check
    the files against; it is returned as is, and :func:`read_checkpoint` decides.

    Args:
        path: the checkpoint directory.

    Returns:
        The manifest.

    Raises:
        CheckpointError: the manifest is missing (interrupted save, not a tune_hydra
            checkpoint) or of an unknown format, or a file is missing, has another size or
            another digest than the manifest says (a stale file from another checkpoint, a
            truncated or a foreign file).
    """
    root = Path(path)
    manifest = _manifest(root)
    check_checkpoint_files(root, os.listdir(root))
    _check_manifest_fields(root, manifest)
    fmt = manifest.get("format")
    if fmt == 1:
        return manifest
    if fmt != FORMAT:
        raise CheckpointError(
            str(root), META_FILE,
            f"has format {fmt!r}; this tune_hydra reads formats 1 and {FORMAT}",
            "Restore it with the tune_hydra version that wrote it, or restore the trial from "
            "an earlier checkpoint",
        )  # fmt: skip
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(str(root), META_FILE, "lists no files", _RESTORE_FIX)
    for name in _DATA_FILES:
        want = files.get(name)
        if (
            not isinstance(want, dict)
            or not _is_int(want.get("bytes"))
            or not isinstance(want.get("sha256"), str)
        ):
            raise CheckpointError(
                str(root), META_FILE, f"does not record the size and sha256 of {name}",
                _RESTORE_FIX,
            )  # fmt: skip
        target = root / name
        if not target.is_file():
            raise CheckpointError(
                str(root), name, "is missing, though the manifest lists it", _RESTORE_FIX
            )
        size, digest = _file_digest(target)
        if size != want["bytes"]:
            raise CheckpointError(
                str(root), name,
                f"has {size} bytes but the manifest says {want['bytes']} (truncated, or "
                f"replaced by a file from another checkpoint or from elsewhere)",
                _RESTORE_FIX,
            )  # fmt: skip
        if digest != want["sha256"]:
            raise CheckpointError(
                str(root), name,
                f"has sha256 {digest[:16]}... but the manifest says {str(want['sha256'])[:16]}"
                f"... (a stale file from another checkpoint, or changed after the save)",
                _RESTORE_FIX,
            )  # fmt: skip
    return manifest


def _load_failure(err: BaseException) -> str:
    """The gist of a failed ``torch.load``: the unpickler's reason when it gives one (not
    its advice to load unsafely), else the first sentence of the message."""
    text = _ANSI_RE.sub("", str(err)).strip()
    found = _UNPICKLER_RE.search(text)
    if found:
        return found.group(1).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    return first.split(". ")[0].rstrip(".")


def _load_safely(root: Path, name: str, legacy: bool) -> dict[str, Any]:
    """``torch.load(root / name, weights_only=True)`` as a dict, or a CheckpointError."""
    import torch

    try:
        obj = torch.load(root / name, map_location="cpu", weights_only=True)
    except Exception as err:  # garbage makes torch raise many kinds: all mean "refused"
        first = _load_failure(err)
        why = (
            "was written by an older tune_hydra (format 1) and holds objects that safe "
            "loading (torch.load weights_only=True) refuses"
            if legacy
            else "was refused by safe loading (torch.load weights_only=True): it is not a "
            "file tune_hydra wrote (it holds objects other than tensors and plain "
            "containers, e.g. a planted pickle payload, or it is not a torch file)"
        )
        raise CheckpointError(str(root), name, f"{why} [{type(err).__name__}: {first}]",
                              _RESTORE_FIX) from None  # fmt: skip
    if not isinstance(obj, dict):
        raise CheckpointError(
            str(root), name, f"holds a {type(obj).__name__}, not a dict", _RESTORE_FIX
        )
    return obj


def read_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Verify a checkpoint (see :func:`verify_checkpoint`), then load it safely.

    Both files load with ``torch.load(..., map_location="cpu", weights_only=True)``: a
    file holding anything but tensors and plain containers is refused, never run. A
    format-1 checkpoint (no digests) is accepted, with a logged warning, only if both files
    load that way; its stored config becomes ``manifest["config_digest"]``.

    Args:
        path: the checkpoint directory.

    Returns:
        ``(model_state, state, manifest)``: the model's ``state_dict``, the resume state
        and the manifest.

    Raises:
        CheckpointError: the manifest is missing or wrong, a file is missing or differs
            from the manifest, a file is refused by ``weights_only`` loading, or the
            loaded state disagrees with the manifest.
    """
    root = Path(path)
    manifest = dict(verify_checkpoint(root))
    legacy = manifest.get("format") == 1
    if legacy:
        for name in _DATA_FILES:
            if not (root / name).is_file():
                raise CheckpointError(str(root), name, "is missing", _RESTORE_FIX)
        logger.warning(
            "checkpoint %s has a format-1 manifest (an older tune_hydra, no file digests): "
            "its files cannot be checked for staleness or corruption; loading them with "
            "weights_only=True. Save a new checkpoint to get a verified one.",
            root,
        )
    model_state = _load_safely(root, MODEL_FILE, legacy)
    state = _load_safely(root, STATE_FILE, legacy)
    if legacy:
        old_config = state.pop(_LEGACY_CONFIG_KEY, None)
        manifest["config_digest"] = (
            config_digest(old_config) if isinstance(old_config, Mapping) else None
        )
        manifest.setdefault("num_shards", state.get("num_shards"))
        manifest.setdefault("shards", None)
    from tune_hydra.engine.runtime.resume import state_problem

    problem = state_problem({**state, "model": model_state})
    if problem is not None:
        field, what = problem
        raise CheckpointError(
            str(root), STATE_FILE if field != "model" else MODEL_FILE,
            f"holds the entry {field!r}, which {what}: {_TAMPERED}. Nothing of it was loaded "
            f"into the trial",
            _RESTORE_FIX,
        )  # fmt: skip
    for key in ("iteration", "epoch", "num_shards"):
        said, held = manifest.get(key), state.get(key)
        if said is not None and held is not None and said != held:
            raise CheckpointError(
                str(root), STATE_FILE,
                f"holds {key} {held!r} but the manifest says {said!r} (files from "
                f"different checkpoints)",
                _RESTORE_FIX,
            )  # fmt: skip
    return model_state, state, manifest


# -------------------------------------------------------------------- a trial's checkpoint
# What a front end saves and restores: a trial (a TaskLoop) into and out of the files
# above. The state dict's layout is ``tune_hydra.engine.runtime.resume``'s; which of its
# entries go where, and what a restore under another config or another cut needs, is
# decided here alone.
_LEGACY_OPTIMIZERS = "optimizers"  # the engine's older per-shard optimizer layout


class Resumable(Protocol):
    """What :func:`save_trial` and :func:`restore_trial` need of a trial (a
    :class:`~tune_hydra.frontends.task_loop.TaskLoop`)."""

    def state(self) -> dict[str, Any]:
        """Everything needed to resume exactly (``tune_hydra.engine.runtime.resume``)."""
        ...

    def load_state(self, state: Mapping[str, Any], cut: list[list[str]] | None = None) -> None:
        """Go on from ``state``; ``cut``: the layer names of each shard of the cut it was
        saved with (a state of the older per-shard layout needs it)."""
        ...

    def cut(self) -> list[list[str]] | None:
        """The layer names of each shard (None: not known)."""
        ...


def save_trial(
    trial: Resumable,
    path: str | os.PathLike[str],
    *,
    trial_id: str,
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """Write the checkpoint of ``trial`` into ``path`` (atomic files, manifest last; see
    :func:`write_checkpoint`). The manifest records a digest of the trial's config, not
    the config itself.

    Args:
        trial: the trial (a ``TaskLoop``).
        path: the checkpoint directory.
        trial_id: the trial's id, for the manifest.
        config: the trial's config (only its digest is stored).

    Returns:
        The manifest that was written.

    Raises:
        CheckpointError: a file could not be written.
    """
    state = trial.state()
    model = state.pop("model")
    return write_checkpoint(
        path, model, state, trial_id=trial_id, config=config, shards=trial.cut()
    )


def restore_trial(
    trial: Resumable,
    path: str | os.PathLike[str],
    *,
    trial_id: str,
    config: Mapping[str, Any],
) -> None:
    """Verify the checkpoint in ``path`` and restore ``trial`` from it.

    Written under another config (a PBT exploit), the optimizers keep the new config's
    hyperparameters (:func:`merge_hyperparameters`). Made with the model cut another way
    (another ``device_memory`` or device count), it restores exactly: the state keeps
    optimizer state per parameter. A checkpoint of the older per-shard layout restores
    under any cut too (its manifest names the cut it was made with).

    Raises:
        CheckpointError: the checkpoint fails verification or does not fit the trial's
            task; nothing of it was loaded.
    """
    model, state, manifest = read_checkpoint(path)  # CheckpointError: nothing loaded
    saved_plan, plan = manifest.get("shards"), trial.cut()
    legacy = _LEGACY_OPTIMIZERS in state  # one optimizer state_dict per shard
    if saved_plan is not None and plan is not None and saved_plan != plan:
        diff = _plan_diff(saved_plan, plan)
        logger.info("tune_hydra: trial %s: re-sharding checkpoint %s (%s)", trial_id, path, diff)
    state["model"] = model
    saved_digest = manifest.get("config_digest")
    key = _LEGACY_OPTIMIZERS if legacy else "optimizer"
    if saved_digest is not None and saved_digest != config_digest(config) and key in state:
        fresh = trial.state()
        state[key] = merge_hyperparameters(state[key], fresh.get("optimizer"))
    from tune_hydra.exceptions import ResumeStateError

    try:
        trial.load_state(state, cut=saved_plan)  # checks the state against the task first
    except ResumeStateError as err:
        raise CheckpointError(
            str(path), STATE_FILE, f"does not fit trial {trial_id}'s task: {err.detail}",
            "Nothing of the checkpoint was loaded into the trial",
        ) from None  # fmt: skip


def _plan_diff(saved: list[list[str]], now: list[list[str]]) -> str:
    """Where two shard plans first differ, in words."""
    i = next(
        (i for i, (a, b) in enumerate(zip(saved, now, strict=False)) if a != b),
        min(len(saved), len(now)),
    )
    return (
        f"{len(saved)} shard(s) in the checkpoint, {len(now)} now; first difference at shard "
        f"{i}: {saved[i] if i < len(saved) else 'none'} in the checkpoint, "
        f"{now[i] if i < len(now) else 'none'} now"
    )


def merge_hyperparameters(loaded: Any, fresh: Any) -> Any:
    """Optimizer state from a checkpoint, with the hyperparameters (``lr``, betas, ...)
    of freshly built optimizers.

    PBT restores a checkpoint into a trial with a *mutated* config: the moments must come
    from the checkpoint but the learning rate from the new config, as in a hand-written
    PBT loop that sets ``lr`` after loading.

    ``loaded`` and ``fresh`` are the engine state's ``"optimizer"``: per-parameter state
    and groups of parameter names (``tune_hydra.engine.runtime.resume``); the result keeps
    ``loaded``'s per-parameter state with ``fresh``'s groups, so each parameter gets the
    hyperparameters the new config gives it, however either was cut into shards. A
    checkpoint of the older layout (one ``state_dict`` per shard, which restores under
    the same cut only) is merged group by group with ``fresh``'s groups, listed in the
    same order. Structures that do not match are left alone.

    Example:
        >>> loaded = {"state": {"0.weight": {"momentum_buffer": 1.0}},
        ...           "param_groups": [{"lr": 0.1, "params": ["0.weight"]}]}
        >>> fresh = {"state": {}, "param_groups": [{"lr": 0.5, "params": ["0.weight"]}]}
        >>> merge_hyperparameters(loaded, fresh)["param_groups"]
        [{'lr': 0.5, 'params': ['0.weight']}]
    """
    fresh_groups = fresh.get("param_groups") if isinstance(fresh, dict) else None
    if not isinstance(fresh_groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in fresh_groups
    ):
        return loaded
    if isinstance(loaded, dict):
        if not isinstance(loaded.get("param_groups"), list):
            return loaded
        old = {n for g in loaded["param_groups"] for n in g.get("params", ())}
        new = {n for g in fresh_groups for n in g["params"]}
        if old != new:
            return loaded
        return {**loaded, "param_groups": [dict(g) for g in fresh_groups]}
    if not isinstance(loaded, list):
        return loaded
    # The older per-shard layout: its groups, shard after shard, pair with fresh's.
    old_groups = [g for sd in loaded if isinstance(sd, dict) for g in sd.get("param_groups") or ()]
    if len(old_groups) != len(fresh_groups) or any(
        len(og.get("params", ())) != len(ng["params"])
        for og, ng in zip(old_groups, fresh_groups, strict=True)
    ):
        return loaded
    pairs = iter(fresh_groups)
    out = []
    for sd in loaded:
        if isinstance(sd, dict) and isinstance(sd.get("param_groups"), list):
            groups = [
                {**{k: v for k, v in next(pairs).items() if k != "params"}, "params": og["params"]}
                for og in sd["param_groups"]
            ]
            sd = {**sd, "param_groups": groups}
        out.append(sd)
    return out


def save_model(folder: str | os.PathLike[str], model_state: Mapping[str, Any]) -> Path:
    """Write a model's ``state_dict`` alone, atomically, as ``folder``'s model file (the
    same file a checkpoint holds): ``model.load_state_dict(torch.load(path))`` works
    outside tune_hydra.

    Returns:
        The file's path.

    Raises:
        CheckpointError: it could not be written (no file is left half written).
    """
    import torch

    out = Path(folder)
    target = out / MODEL_FILE
    tmp = out / temp_name(MODEL_FILE)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tmp.open("xb") as f:
            torch.save(dict(model_state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(out)
    except Exception as err:
        raise CheckpointError(
            str(out), MODEL_FILE, f"could not be written ({type(err).__name__}: {err})",
            "Check free disk space and permissions of the folder; the trial's model was not "
            "saved",
        ) from err  # fmt: skip
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return target


def not_a_folder(checkpoint: Any) -> CheckpointError:
    """The error for a checkpoint that reached a restore as an object, not a folder (Ray
    passes a dict only when the folder held a pickled one: never a tune_hydra checkpoint)."""
    return CheckpointError(
        "(unknown folder)",
        None,
        f"reached tune_hydra as a {type(checkpoint).__name__}, not a folder: tune_hydra "
        f"checkpoints are folders holding {MODEL_FILE}, {STATE_FILE} and {META_FILE}",
        "Restore the trial from a checkpoint tune_hydra wrote",
    )
