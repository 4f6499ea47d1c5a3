"""The checkpoint file format, without Ray: exact round trips, a manifest that catches
stale, truncated and foreign files, planted pickle payloads that never run, and atomic
writes that leave no temp file behind."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import make_task, mlp
from tune_hydra.engine import Engine
from tune_hydra.exceptions import CheckpointError, TuneHydraError
from tune_hydra.frontends import checkpoint as ck
from tune_hydra.frontends.checkpoint import (
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    config_digest,
    discard_partial_save,
    is_temp_name,
    read_checkpoint,
    temp_name,
    verify_checkpoint,
    write_checkpoint,
)
from tune_hydra.frontends.task_loop import TaskLoop


# ------------------------------------------------------------- helpers (also used by Ray tests)
class Payload:
    """Pickles as a call that creates ``marker``: what an attacker plants in a ``.pt`` file."""

    def __init__(self, marker: str | Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def replace_file(ckpt: Path, name: str, obj: Any, *, update_manifest: bool) -> None:
    """``torch.save(obj)`` over checkpoint file ``name``; with ``update_manifest`` its size
    and digest in the manifest are updated to match (an attacker who knows the format)."""
    torch.save(obj, ckpt / name)
    if update_manifest:
        data = (ckpt / name).read_bytes()
        meta = json.loads((ckpt / META_FILE).read_text())
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (ckpt / META_FILE).write_text(json.dumps(meta))


def plant_payload(ckpt: Path, marker: Path, *, update_manifest: bool) -> None:
    """Rewrite ``hydra_state.pt`` of checkpoint ``ckpt`` with a :class:`Payload` inside."""
    state = torch.load(ckpt / STATE_FILE, weights_only=True)
    state["extra"] = Payload(marker)
    replace_file(ckpt, STATE_FILE, state, update_manifest=update_manifest)


def _state(iteration: int = 4, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model state_dict and a resume state shaped like the engine's, Adam state included."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    params = list(model.parameters())
    state = {
        "optimizers": [opt.state_dict(), None],
        "grads": [[p.grad.clone() for p in params[:2]], [None, params[2].grad.clone()]],
        "rng": {"cpu": torch.get_rng_state(), "cuda": None},
        "epoch_rng": torch.Generator().manual_seed(7).get_state(),
        "seed": 3,
        "iteration": iteration,
        "epoch": iteration // 2,
        "batch_in_epoch": 1,
        "num_shards": 2,
    }
    return model.state_dict(), state


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    assert type(got) is type(want) or (isinstance(got, dict) and isinstance(want, dict)), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A genuine checkpoint (iteration 4) in ``tmp_path/ckpt``."""
    model, state = _state()
    write_checkpoint(tmp_path / "ckpt", model, state, trial_id="t1", config={"lr": 0.1})
    return tmp_path / "ckpt"


def _listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# ------------------------------------------------------------------------------ round trips
def test_round_trip_is_exact(tmp_path: Path) -> None:
    model, state = _state()
    shards = [["0"], ["1"]]
    manifest = write_checkpoint(
        tmp_path, model, state, trial_id="t1", config={"lr": 0.1}, shards=shards
    )
    assert _listing(tmp_path) == sorted([META_FILE, MODEL_FILE, STATE_FILE])
    got_model, got_state, got_manifest = read_checkpoint(tmp_path)
    _assert_same(got_model, model)
    _assert_same(got_state, state)
    assert got_manifest == manifest == json.loads((tmp_path / META_FILE).read_text())
    assert manifest["format"] == ck.FORMAT == 2
    assert (manifest["iteration"], manifest["epoch"], manifest["num_shards"]) == (4, 2, 2)
    assert manifest["trial_id"] == "t1" and manifest["shards"] == shards
    assert manifest["config_digest"] == config_digest({"lr": 0.1})
    for name in (MODEL_FILE, STATE_FILE):
        data = (tmp_path / name).read_bytes()
        assert manifest["files"][name] == {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    # the user's model.pt stays a plain state_dict file
    assert list(torch.load(tmp_path / MODEL_FILE, weights_only=True)) == list(model)


def test_engine_state_round_trip_resumes_exactly(tmp_path: Path) -> None:
    """A task loop's real state loads with weights_only=True and resumes bit for bit."""
    engines = [Engine(devices="cpu", device_memory=24_000) for _ in range(2)]
    try:
        a = TaskLoop("t", make_task(mlp(), "adam"), engines[0], seed=5)
        b = TaskLoop("t", make_task(mlp(seed=9), "adam"), engines[1], seed=5)  # other weights
        a.start(2).result(timeout=120)
        state = a.state()
        model = state.pop("model")
        write_checkpoint(tmp_path, model, state, shards=a.cut())
        got_model, got_state, manifest = read_checkpoint(tmp_path)
        assert manifest["num_shards"] == state["num_shards"] >= 3
        b.load_state({**got_state, "model": got_model})
        a.start(1).result(timeout=120)
        b.start(1).result(timeout=120)
        _assert_same(b.state(), a.state())
        a.close()
        b.close()
    finally:
        for eng in engines:
            eng.close()


def test_module_imports_without_torch() -> None:
    code = (
        "import sys, tune_hydra.frontends.checkpoint as c; c.config_digest({'a': 1}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------ corruption
def _truncate(ckpt: Path, name: str) -> None:
    data = (ckpt / name).read_bytes()
    (ckpt / name).write_bytes(data[: len(data) // 2])


def _stale_model(ckpt: Path) -> None:
    """model.pt of an earlier checkpoint of the same trial (same size, other weights)."""
    earlier = ckpt.parent / "earlier"
    model, state = _state(iteration=2, seed=1)
    write_checkpoint(earlier, model, state)
    (ckpt / MODEL_FILE).write_bytes((earlier / MODEL_FILE).read_bytes())


def _foreign_state(ckpt: Path) -> None:
    """Random bytes of the right length in hydra_state.pt."""
    size = (ckpt / STATE_FILE).stat().st_size
    (ckpt / STATE_FILE).write_bytes(os.urandom(size))


def _garbage_with_digest(ckpt: Path) -> None:
    """Random bytes in hydra_state.pt, with the manifest updated to match them."""
    data = os.urandom(4096)
    (ckpt / STATE_FILE).write_bytes(data)
    meta = json.loads((ckpt / META_FILE).read_text())
    meta["files"][STATE_FILE] = {"bytes": 4096, "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / META_FILE).write_text(json.dumps(meta))


def _edit_manifest(**changes: Any) -> Any:
    def edit(ckpt: Path) -> None:
        meta = json.loads((ckpt / META_FILE).read_text())
        meta.update(changes)
        (ckpt / META_FILE).write_text(json.dumps(meta))

    return edit


CORRUPTIONS = {
    "manifest missing": (lambda c: (c / META_FILE).unlink(), META_FILE, "interrupted"),
    "manifest not json": (lambda c: (c / META_FILE).write_text("{"), META_FILE, "readable"),
    "manifest a list": (lambda c: (c / META_FILE).write_text("[]"), META_FILE, "list"),
    "format unknown": (_edit_manifest(format=3), META_FILE, "format 3"),
    "digests missing": (_edit_manifest(files={}), META_FILE, "does not record"),
    "model missing": (lambda c: (c / MODEL_FILE).unlink(), MODEL_FILE, "is missing"),
    "state truncated": (lambda c: _truncate(c, STATE_FILE), STATE_FILE, "truncated"),
    "model truncated": (lambda c: _truncate(c, MODEL_FILE), MODEL_FILE, "truncated"),
    "stale model": (_stale_model, MODEL_FILE, "sha256 .*stale"),
    "foreign state": (_foreign_state, STATE_FILE, "sha256"),
    "garbage, digest updated": (_garbage_with_digest, STATE_FILE, "weights_only=True"),
    "manifest of another iteration": (_edit_manifest(iteration=9), STATE_FILE, "iteration 4"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_raises_checkpoint_error(ckpt: Path, kind: str) -> None:
    spoil, file, pattern = CORRUPTIONS[kind]
    read_checkpoint(ckpt)  # genuine before
    spoil(ckpt)
    with pytest.raises(CheckpointError, match=pattern) as info:
        read_checkpoint(ckpt)
    err = info.value
    assert err.checkpoint == str(ckpt) and err.file == file
    text = str(err)
    assert text.startswith(f"checkpoint {ckpt}: {file} ") and "earlier checkpoint" in text
    assert isinstance(err, TuneHydraError) and isinstance(err, ValueError)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="the directory does not exist") as info:
        read_checkpoint(tmp_path / "nowhere")
    assert info.value.file is None


@pytest.mark.parametrize("update_manifest", [False, True], ids=["digest-stale", "digest-updated"])
def test_planted_payload_never_runs(ckpt: Path, tmp_path: Path, update_manifest: bool) -> None:
    marker = tmp_path / "payload-ran"
    plant_payload(ckpt, marker, update_manifest=update_manifest)
    # the payload is live: an unsafe load runs it
    torch.load(ckpt / STATE_FILE, weights_only=False)
    assert marker.read_text() == "payload ran"
    marker.unlink()

    want = "weights_only=True" if update_manifest else "but the manifest says"
    with pytest.raises(CheckpointError, match=want) as info:
        read_checkpoint(ckpt)
    assert info.value.file == STATE_FILE and str(ckpt) in str(info.value)
    assert not marker.exists()


# ---------------------------------------------------------------------------- atomic writes
def _fail_on(monkeypatch: pytest.MonkeyPatch, target: str, call: int, exc: BaseException) -> None:
    """Make the ``call``-th call of ``torch.save`` / ``os.replace`` / ``os.fsync`` raise."""
    owner, attr = {"save": (torch, "save"), "replace": (os, "replace"), "fsync": (os, "fsync")}[
        target
    ]
    real = getattr(owner, attr)
    calls = {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == call:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, wrapper)


@pytest.mark.parametrize(
    ("target", "call", "file"),
    [
        ("save", 1, MODEL_FILE),
        ("save", 2, STATE_FILE),
        ("fsync", 2, STATE_FILE),
        ("replace", 2, STATE_FILE),
        ("replace", 3, META_FILE),
        ("fsync", 3, META_FILE),
    ],
)
def test_failed_write_leaves_no_temp_file_and_no_mix(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, target: str, call: int, file: str
) -> None:
    """A save over an existing checkpoint fails half way: no temp file is left, and the
    directory reads as interrupted (never as the old manifest over new files)."""
    model, state = _state(iteration=6, seed=2)
    _fail_on(monkeypatch, target, call, OSError(28, "No space left on device"))
    with pytest.raises(CheckpointError, match="No space left") as info:
        write_checkpoint(ckpt, model, state)
    assert info.value.file == file and "could not be written" in str(info.value)
    monkeypatch.undo()
    assert not [n for n in os.listdir(ckpt) if is_temp_name(n)], _listing(ckpt)
    assert META_FILE not in os.listdir(ckpt)
    with pytest.raises(CheckpointError, match="interrupted"):
        read_checkpoint(ckpt)


def test_interrupt_during_write_removes_temp_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, state = _state()
    _fail_on(monkeypatch, "save", 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, model, state)
    assert _listing(tmp_path) == []  # the model's temp file is gone too


def test_unsavable_state_is_a_checkpoint_error(tmp_path: Path) -> None:
    model, state = _state()
    with pytest.raises(CheckpointError, match=STATE_FILE):
        write_checkpoint(tmp_path, model, {**state, "bad": lambda: None})
    assert not [n for n in os.listdir(tmp_path) if is_temp_name(n)]


def test_discard_partial_save(tmp_path: Path) -> None:
    keep_dir = tmp_path / "kept"
    keep_dir.mkdir()
    (keep_dir / MODEL_FILE).write_text("old")
    (keep_dir / "notes.txt").write_text("user's")
    partial = [temp_name(STATE_FILE), temp_name(META_FILE), STATE_FILE]
    for name in partial:
        (keep_dir / name).write_text("partial")
    removed = discard_partial_save(keep_dir, keep={MODEL_FILE, "notes.txt"})
    assert sorted(removed) == sorted(partial)
    assert _listing(keep_dir) == sorted([MODEL_FILE, "notes.txt"])

    made = tmp_path / "made-for-this-save"
    made.mkdir()
    (made / temp_name(MODEL_FILE)).write_text("partial")
    assert discard_partial_save(made, remove_dir=True)[-1] == str(made)
    assert not made.exists()
    assert discard_partial_save(made) == []  # gone already: nothing to do


def test_temp_names() -> None:
    names = {temp_name(MODEL_FILE) for _ in range(3)}
    assert len(names) == 3 and all(is_temp_name(n) for n in names)
    assert all(n.startswith(f".{MODEL_FILE}.tmp-") for n in names)
    for other in (MODEL_FILE, ".model.pt.tmp-xyz", ".other.pt.tmp-" + "0" * 32, "tmpab12"):
        assert not is_temp_name(other)


# ------------------------------------------------------------------------- older checkpoints
def _format_1(path: Path, state_extra: dict[str, Any]) -> None:
    """A checkpoint as tune_hydra wrote it before manifests had digests."""
    path.mkdir()
    model, state = _state()
    torch.save(model, path / MODEL_FILE)
    torch.save({**state, **state_extra}, path / STATE_FILE)
    meta = {"format": 1, "trial_id": "t", "iteration": 4, "epoch": 2,
            "files": {"model": MODEL_FILE, "state": STATE_FILE}}  # fmt: skip
    (path / META_FILE).write_text(json.dumps(meta))


def test_format_1_loads_safely_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _format_1(tmp_path / "v1", {"_tune_config": {"lr": 0.1, "width": 16}})
    with caplog.at_level(logging.WARNING, logger="tune_hydra.frontends.checkpoint"):
        model, state, manifest = read_checkpoint(tmp_path / "v1")
    assert "format-1" in caplog.text and str(tmp_path / "v1") in caplog.text
    _assert_same(model, _state()[0])
    assert "_tune_config" not in state and state["iteration"] == 4
    assert manifest["config_digest"] == config_digest({"width": 16, "lr": 0.1})


def test_format_1_with_unsafe_objects_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    _format_1(tmp_path / "v1", {"_tune_config": {"lr": 0.1}, "x": Payload(marker)})
    with pytest.raises(CheckpointError, match="older tune_hydra") as info:
        read_checkpoint(tmp_path / "v1")
    assert info.value.file == STATE_FILE and not marker.exists()
    assert verify_checkpoint(tmp_path / "v1")["format"] == 1  # nothing to check there


# -------------------------------------------------------------------------------- the error
def test_checkpoint_error_survives_pickling() -> None:
    err = CheckpointError("/ck/checkpoint_000002", MODEL_FILE, "has 3 bytes", "Do this")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is CheckpointError and str(back) == str(err)
    assert (back.checkpoint, back.file, back.problem, back.fix) == (
        "/ck/checkpoint_000002", MODEL_FILE, "has 3 bytes", "Do this",
    )  # fmt: skip
    assert str(err) == f"checkpoint /ck/checkpoint_000002: {MODEL_FILE} has 3 bytes. Do this."


# ------------------------------------------------------------------------- the config digest
def _f(x: int) -> int:
    return x


def test_config_digest() -> None:
    base = {"lr": 0.01, "layers": [1, 2], "opt": {"b": (0.9, 0.99), "a": None}}
    same = {"opt": {"a": None, "b": [0.9, 0.99]}, "layers": [1, 2], "lr": 0.01}
    assert config_digest(base) == config_digest(same)
    assert len(config_digest(base)) == 64
    assert config_digest(base) != config_digest({**base, "lr": 0.02})
    assert config_digest({1: "a", "1": "b"}) == config_digest({"1": "b", 1: "a"})  # no TypeError
    assert config_digest({1: "a", "1": "b"}) != config_digest({1: "b", "1": "a"})
    # objects count by their repr, without addresses (same digest in every process)
    assert config_digest({"fn": _f}) == config_digest({"fn": _f})
    assert "0x" not in ck._canonical({"fn": _f})["fn"]
    assert config_digest({"fn": _f}) != config_digest({"fn": test_config_digest})


# ------------------------------------------------- issue 23: foreign files, tampered fields
def test_a_folder_holding_a_foreign_file_is_refused_before_reading(ckpt: Path) -> None:
    from tune_hydra.exceptions import ForeignCheckpointFileError

    ck.check_checkpoint_files(ckpt, os.listdir(ckpt))  # genuine
    (ckpt / "_dict_checkpoint.pkl").write_bytes(pickle.dumps({"x": 1}))
    (ckpt / "notes.txt").write_text("hi")
    with pytest.raises(ForeignCheckpointFileError) as info:
        read_checkpoint(ckpt)
    err = info.value
    assert isinstance(err, CheckpointError) and err.file == "_dict_checkpoint.pkl"
    text = str(err)
    assert "unpickle" in text and "notes.txt" in text and "earlier checkpoint" in text
    assert f"{MODEL_FILE}, {STATE_FILE} and {META_FILE}" in text
    (ckpt / "_dict_checkpoint.pkl").unlink()
    with pytest.raises(ForeignCheckpointFileError, match=r"notes\.txt is not a file"):
        read_checkpoint(ckpt)


def _edit_state(**changes: Any) -> Any:
    """Rewrite hydra_state.pt with ``changes`` (None: drop the key), digest updated."""

    def edit(ckpt: Path) -> None:
        state = torch.load(ckpt / STATE_FILE, weights_only=True)
        for key, value in changes.items():
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
        replace_file(ckpt, STATE_FILE, state, update_manifest=True)

    return edit


def _nested_manifest(ckpt: Path) -> None:
    meta = (ckpt / META_FILE).read_text().rstrip().rstrip("}")
    (ckpt / META_FILE).write_text(meta + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")


TAMPERED = {
    # field -> (spoil, file at fault, what the message says)
    "manifest nested 100k deep": (_nested_manifest, META_FILE, "nests .* more than 8 deep"),
    "manifest shards not lists": (_edit_manifest(shards=[1, 2]), META_FILE, "holds shards"),
    "manifest iteration a string": (_edit_manifest(iteration="4"), META_FILE, "iteration '4'"),
    "manifest bytes a string": (
        _edit_manifest(files={MODEL_FILE: {"bytes": "1", "sha256": "0"}}),
        META_FILE,
        "does not record",
    ),
    "rng too short": (
        _edit_state(rng={"cpu": torch.zeros(7, dtype=torch.uint8), "cuda": None}),
        STATE_FILE,
        r"'rng'.*7 bytes, not the 5056",
    ),
    "rng a float tensor": (
        _edit_state(rng={"cpu": torch.zeros(5056), "cuda": None}),
        STATE_FILE,
        r"'rng'.*CPU entry.*float32",
    ),
    "cuda rng garbage": (
        _edit_state(rng={"cpu": torch.get_rng_state(), "cuda": torch.zeros(3)}),
        STATE_FILE,
        r"'rng'.*CUDA entry",
    ),
    "epoch rng missing": (_edit_state(epoch_rng=None), STATE_FILE, "'epoch_rng'.*None"),
    "negative batch": (_edit_state(batch_in_epoch=-1), STATE_FILE, "'batch_in_epoch'.*-1"),
    "epoch a tensor": (_edit_state(epoch=torch.tensor(2)), STATE_FILE, "'epoch'.*int64 tensor"),
}


@pytest.mark.parametrize("kind", list(TAMPERED))
def test_tampered_fields_are_named_before_anything_loads(ckpt: Path, kind: str) -> None:
    """Issue 23, item 8: a manifest nested too deep (was a RecursionError) and resume
    fields no save writes (a bad RNG state was a raw RuntimeError inside training) are a
    CheckpointError that names the field and says the checkpoint is damaged."""
    spoil, file, pattern = TAMPERED[kind]
    spoil(ckpt)
    with pytest.raises(CheckpointError, match=pattern) as info:
        read_checkpoint(ckpt)
    err = info.value
    assert err.file == file and str(ckpt) in str(err)
    assert "damaged or was tampered with" in str(err) or "does not record" in str(err)


# --------------------------------------- a trial's checkpoint: the one way both front ends save
def _sgd_task(seed: int, lr: float) -> Any:
    """``make_task`` with SGD-momentum at ``lr`` (a trial's config), float64."""
    import tune_hydra as th

    model, data = mlp(seed=seed), make_task(mlp()).train_data
    return th.ModelTask(
        model, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9), data
    )


def _lrs(loop: TaskLoop) -> set[float]:
    return {g["lr"] for g in loop.state()["optimizer"]["param_groups"]}


def test_a_trial_restores_exactly_and_keeps_a_mutated_configs_hyperparameters(
    tmp_path: Path,
) -> None:
    """save_trial/restore_trial (the engine actor's save/load): a resume trains on bit for
    bit; the same config keeps the checkpoint's hyperparameters, another (a PBT exploit)
    keeps the moments but takes its own lr; a model cut another way restores too."""
    with Engine("cpu", device_memory=24_000) as two, Engine("cpu") as one:
        a = TaskLoop("a", _sgd_task(0, 0.05), two, seed=3)
        a.start(1).result(timeout=120)
        manifest = ck.save_trial(a, tmp_path, trial_id="trial-a", config={"lr": 0.05})
        assert manifest["trial_id"] == "trial-a" and manifest["iteration"] == 1
        assert manifest["config_digest"] == config_digest({"lr": 0.05})
        assert manifest["num_shards"] == len(a.cut()) >= 2
        assert manifest["shards"] == a.cut()
        a.start(1).result(timeout=120)
        want = a.state()

        b = TaskLoop("b", _sgd_task(9, 0.05), one, seed=3)  # other weights: the checkpoint's win
        assert len(b.cut()) == 1
        ck.restore_trial(b, tmp_path, trial_id="b", config={"lr": 0.05})
        b.start(1).result(timeout=120)
        got = b.state()
        for k, v in want["model"].items():
            torch.testing.assert_close(got["model"][k], v, rtol=0, atol=0)
        assert _lrs(b) == {0.05}

        c = TaskLoop("c", _sgd_task(9, 0.2), one, seed=3)
        ck.restore_trial(c, tmp_path, trial_id="c", config={"lr": 0.2})  # exploit
        saved = torch.load(tmp_path / STATE_FILE, weights_only=True)["optimizer"]["state"]
        restored = c.state()["optimizer"]["state"]
        assert _lrs(c) == {0.2} and sorted(restored) == sorted(saved)
        for k, v in saved.items():
            assert torch.equal(restored[k]["momentum_buffer"], v["momentum_buffer"])
        for loop in (a, b, c):
            loop.close()


def test_a_checkpoint_of_another_task_is_refused_and_nothing_loads(tmp_path: Path) -> None:
    with Engine("cpu") as engine:
        a = TaskLoop("a", _sgd_task(0, 0.1), engine)
        a.start(1).result(timeout=120)
        ck.save_trial(a, tmp_path, trial_id="a", config={})
        import tune_hydra as th

        wide = th.ModelTask(
            mlp(width=32), nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.1),
            make_task(mlp()).train_data,
        )  # fmt: skip
        w = TaskLoop("w", wide, engine)
        w.cut()
        before = w.state()
        with pytest.raises(CheckpointError, match="does not fit trial w's task") as info:
            ck.restore_trial(w, tmp_path, trial_id="w", config={})
        assert info.value.file == STATE_FILE
        after = w.state()
        assert after["iteration"] == 0
        assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())
        a.close()
        w.close()


def test_both_front_ends_write_the_same_model_file(tmp_path: Path) -> None:
    """The model file of a trial's checkpoint (HydraExecutor) and the one th.optimize
    saves hold the same state_dict, loadable into the user's own model."""
    with Engine("cpu") as engine:
        loop = TaskLoop("a", _sgd_task(0, 0.1), engine)
        loop.start(1).result(timeout=120)
        ck.save_trial(loop, tmp_path / "ckpt", trial_id="a", config={})
        model_state = loop.state()["model"]
        loop.close()
    path = ck.save_model(tmp_path / "trial_0", model_state)
    assert path == tmp_path / "trial_0" / MODEL_FILE and _listing(path.parent) == [MODEL_FILE]
    for file in (path, tmp_path / "ckpt" / MODEL_FILE):
        fresh = mlp(seed=5)
        fresh.load_state_dict(torch.load(file, weights_only=True))
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, model_state[k]), (file, k)


def test_save_model_failure_is_a_checkpoint_error_and_leaves_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="could not be written") as info:
        ck.save_model(blocker / "trial_0", {"w": torch.zeros(2)})
    assert info.value.file == MODEL_FILE
    with pytest.raises(CheckpointError, match="could not be written"):
        ck.save_model(tmp_path / "t", {"w": lambda: 0})  # torch cannot save a lambda
    assert _listing(tmp_path / "t") == []


def test_a_checkpoint_that_is_no_folder_names_the_files_it_should_hold() -> None:
    err = ck.not_a_folder({"model": 1})
    assert isinstance(err, CheckpointError) and "reached tune_hydra as a dict" in str(err)
    assert all(name in str(err) for name in (MODEL_FILE, STATE_FILE, META_FILE))
