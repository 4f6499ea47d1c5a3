"""A task's exact resume point: what :meth:`TaskRunner.get_state` captures between
iterations and :meth:`TaskRunner.set_state` loads into a fresh runner.

Besides the weights it holds the optimizers' state, any accumulated gradients, the task's
RNG streams and where in the epoch it stopped (with the epoch's starting RNG, so the data
order is replayed and the batches already seen are skipped): training resumed from it
equals training that never stopped.

The state does not depend on how the model is cut. Every torch optimizer keeps its state
per parameter (momentum buffers, Adam's moments and step counters), so the engine's
per-shard optimizers are stored as one state keyed by each parameter's *qualified name*
(``model.named_parameters()``; a tied tensor under its first name), and gradients
likewise. :func:`restore` rebuilds every shard's optimizer state for the parameters the
runner's own plan puts in that shard, so a state made under one ``device_memory`` (or
device count) restores exactly under another. The layout:

- ``"optimizer"``: ``{"state": {name: that parameter's optimizer state},
  "param_groups": [{hyperparameters..., "params": [name, ...]}, ...]}`` -- torch's own
  ``state_dict`` layout with names instead of integer ids; the groups of every shard's
  optimizer, in shard order;
- ``"param_grads"``: ``{name: gradient}`` for the parameters that hold one (gradients
  accumulated in the middle of an accumulation group);
- ``"num_shards"``: how many shards the model was cut into (informational);
- ``"lr_scheduler"`` (with a task ``lr_scheduler``): one scheduler's ``state_dict``.
  Every shard's scheduler follows the same schedule (same factory, same number of steps),
  so their states are equal; the one stored is loaded into every shard's scheduler,
  whatever the cut.

States written before this layout (``"optimizers"``: one ``state_dict`` per shard, and
``"grads"``: one list per shard) still load into a runner cut into as many shards.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import tune_hydra as th
    >>> from tune_hydra.engine import Engine
    >>> def task():
    ...     torch.manual_seed(0)
    ...     model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    ...     data = [(torch.randn(2, 4, dtype=torch.float64),
    ...              torch.randn(2, 1, dtype=torch.float64))]
    ...     return th.ModelTask(model, nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=0.1),
    ...                         data)
    >>> with Engine("cpu", max_layers_per_shard=1) as three, Engine("cpu") as one:
    ...     three.add_task("a", task(), seed=0), one.add_task("a", task(), seed=0)
    ...     _ = three.train("a", 1).result(timeout=60)
    ...     state = three.get_state("a")
    ...     one.set_state("a", state)  # cut into 3 shards, restored into 1
    ...     sorted(state["optimizer"]["state"]) == sorted(one.get_state("a")["optimizer"]["state"])
    (3, 1)
    True
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.engine.runtime import rng
from tune_hydra.exceptions import ResumeStateError

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.runner import ShardRuntime, TaskRunner
    from tune_hydra.engine.task import ModelTask

# Per-parameter keys of torch's param_groups, never hyperparameters of a group.
_NOT_HYPER = ("params", "param_names")


def capture(runner: TaskRunner) -> dict[str, Any]:
    """Everything needed to resume ``runner`` exactly (tensors cloned, on the host side
    of the shard stores: the engine calls this between iterations).

    Args:
        runner: the task's runner, idle (between iterations).

    Returns:
        The resume state, in the per-parameter layout described in the module docstring.
    """
    model = runner.task.model
    assert isinstance(model, nn.Module)
    names = param_names(model)
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for s in runner.shards:
        if s.optimizer is None:
            continue
        sd = s.optimizer.state_dict()
        for live, saved in zip(s.optimizer.param_groups, sd["param_groups"], strict=True):
            keys = [names[id(p)] for p in live["params"]]
            hyper = {k: copy.deepcopy(v) for k, v in saved.items() if k not in _NOT_HYPER}
            groups.append({**hyper, "params": keys})
            for key, index in zip(keys, saved["params"], strict=True):
                if index in sd["state"]:
                    state[key] = copy.deepcopy(sd["state"][index])
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {"state": state, "param_groups": groups},
        "param_grads": {
            names[id(p)]: p.grad.detach().clone()
            for s in runner.shards
            for p in s.params
            if p.grad is not None
        },
        "rng": {"cpu": runner.rng.cpu.clone(), "cuda": _clone(runner.rng.cuda)},
        "epoch_rng": runner.data.epoch_rng(),
        "seed": runner.options.seed,
        "iteration": runner.iteration,
        "epoch": runner.data.epoch,
        "batch_in_epoch": runner.data.batch_in_epoch,
        "num_shards": len(runner.shards),
        **_scheduler_state(runner),
    }


def restore(runner: TaskRunner, state: dict[str, Any]) -> None:
    """Load :func:`capture`'s output into a fresh ``runner``, whatever plan it was
    captured under (a state of the older per-shard layout needs the same shard count).

    Args:
        runner: a runner built for the task, not trained since.
        state: what :func:`capture` returned (possibly through a checkpoint file).

    Raises:
        ResumeStateError: the state does not fit the runner's model (parameters it does
            not have, or lacks), or is of the older per-shard layout and the model is now
            cut into another number of shards.
    """
    model = runner.task.model
    assert isinstance(model, nn.Module)
    # Everything is checked before anything is loaded: a damaged or tampered state must
    # not leave the model half restored, nor fail later inside training.
    refuse(runner.name, state_problem(state) or position_problem(runner.task, state))
    if "optimizers" in state:  # the per-shard layout of older checkpoints
        _check_legacy(runner, state)
        refuse(runner.name, _model_problem(model, state), fits=True)
        model.load_state_dict(state["model"])
        _restore_per_shard(runner, state)
    else:
        names = param_names(model)
        optimizer = state.get("optimizer")
        if not isinstance(optimizer, Mapping):
            raise ResumeStateError(
                runner.name,
                "the resume state holds no optimizer state (no 'optimizer' entry): it is not "
                "what Engine.get_state() returned. Restore from an engine state or a "
                "tune_hydra checkpoint",
            )
        shard_states = rebuild_optimizer_states(runner, optimizer, names)
        refuse(runner.name, _model_problem(model, state), fits=True)
        model.load_state_dict(state["model"])
        for s, sd in zip(runner.shards, shard_states, strict=True):
            if s.optimizer is not None and sd is not None:
                s.optimizer.load_state_dict(sd)
        grads = state.get("param_grads") or {}
        for s in runner.shards:
            for p in s.params:
                g = grads.get(names[id(p)])
                p.grad = None if g is None else g.to(p.device, copy=True)
    _restore_schedulers(runner, state)
    # With max_grad_norm: the norms of the last backward, which a partial accumulation
    # group at the end of an epoch clips with once the next iteration starts. The
    # gradients have not changed since, so they are those of the restored gradients.
    runner.stepper.remeasure(runner.shards)
    stream = rng.RngState(state["rng"]["cpu"].clone(), _clone(state["rng"]["cuda"]))
    runner.resume_at(state["iteration"], stream)
    runner.data.resume_at(state["epoch"], state["batch_in_epoch"], state["epoch_rng"])


_CUDA_RNG_BYTES = 16  # a CUDA generator's state: philox seed and offset, 8 bytes each


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _cpu_rng_problem(value: Any) -> str | None:
    """Why ``value`` is not a CPU generator state torch accepts, or None."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        return f"is {_described(value)}, not a CPU generator state (a 1-D uint8 tensor)"
    want = torch.get_rng_state().numel()
    if value.numel() != want:
        return f"holds {value.numel()} bytes, not the {want} of a CPU generator state"
    try:
        torch.Generator().set_state(value.cpu())
    except RuntimeError as err:
        return f"is refused by torch as a generator state ({str(err).splitlines()[0]})"
    return None


def state_problem(state: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of a resume state that :func:`capture` never writes, as
    ``(field, what is wrong with it)``, or None. Checks what does not depend on the task:
    the counters, the RNG states, and that the model and gradients are tensors. Nothing is
    loaded (the checkpoint reader calls it right after reading the file).

    Example:
        >>> state_problem({"iteration": -1})
        ('iteration', 'is -1, not a whole number >= 0')
    """
    for field in ("iteration", "epoch", "batch_in_epoch"):
        value = state.get(field)
        if not _whole(value):
            return field, f"is {_described(value)}, not a whole number >= 0"
    rng_state = state.get("rng")
    if not isinstance(rng_state, Mapping) or "cpu" not in rng_state:
        return "rng", f"is {_described(rng_state)}, not {{'cpu': state, 'cuda': state or None}}"
    problem = _cpu_rng_problem(rng_state["cpu"])
    if problem is not None:
        return "rng", f"has a CPU entry that {problem}"
    cuda = rng_state.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, torch.Tensor)
        and cuda.dtype == torch.uint8
        and cuda.dim() == 1
        and cuda.numel() == _CUDA_RNG_BYTES
    ):
        return "rng", (
            f"has a CUDA entry that is {_described(cuda)}, not None or a CUDA generator state "
            f"({_CUDA_RNG_BYTES} uint8 bytes)"
        )
    problem = _cpu_rng_problem(state.get("epoch_rng"))
    if problem is not None:
        return "epoch_rng", problem
    for field in ("model", "param_grads"):
        value = state.get(field, {} if field == "param_grads" else None)
        if value is None and field == "param_grads":
            continue
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and (isinstance(v, torch.Tensor) or v is None)
            for k, v in value.items()
        ):
            return field, f"is {_described(value)}, not a mapping of names to tensors"
    return None


def refuse(name: str, problem: tuple[str, str] | None, *, fits: bool = False) -> None:
    """Raise task ``name``'s :class:`ResumeStateError` of ``problem`` (None: nothing to
    refuse). ``fits``: the problem is how the state fits the model (it may be another
    model's)."""
    if problem is None:
        return
    field, what = problem
    why = (
        "the state was made for another model (make_task must build the same architecture "
        "for this config), or it is damaged. Restore it into the model it was made with"
        if fits
        else "no capture writes that, so the state (or the checkpoint it came from) is "
        "damaged or was tampered with. Restore from an earlier checkpoint, or start the "
        "task afresh"
    )
    raise ResumeStateError(name, f"the resume state's {field!r} {what}: {why}")


def position_problem(task: ModelTask, state: Mapping[str, Any]) -> tuple[str, str] | None:
    """The position in the data past the end of ``task``'s ``train_data`` (when it has
    a length), or None."""
    try:
        batches = len(task.train_data)  # type: ignore[arg-type]
    except TypeError:  # an iterable without a length: checked as the epoch replays
        batches = None
    if batches is not None and state["batch_in_epoch"] > batches:
        return "batch_in_epoch", (
            f"is {state['batch_in_epoch']}, past the end of the task's train_data "
            f"({batches} batches per epoch)"
        )
    return None


def _model_problem(model: nn.Module, state: Mapping[str, Any]) -> tuple[str, str] | None:
    """Model tensors or gradients of the state that do not fit ``model`` (names, shapes),
    or None: ``load_state_dict`` would copy the tensors that fit before it complains."""
    saved = state["model"]
    own = model.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    if missing or unexpected:
        which = f"lacks {_listed(missing)}" if missing else f"has unknown {_listed(unexpected)}"
        return "model", f"does not fit the task's model (it {which})"
    for key, tensor in own.items():
        if saved[key] is None or tuple(saved[key].shape) != tuple(tensor.shape):
            got = None if saved[key] is None else tuple(saved[key].shape)
            return "model", f"holds {key!r} of shape {got}, the model's is {tuple(tensor.shape)}"
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, grad in (state.get("param_grads") or {}).items():
        if grad is not None and name in shapes and tuple(grad.shape) != shapes[name]:
            return "param_grads", (
                f"holds a gradient of shape {tuple(grad.shape)} for {name!r}, whose shape is "
                f"{shapes[name]}"
            )
    return None


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


def _scheduler_state(runner: TaskRunner) -> dict[str, Any]:
    """``{"lr_scheduler": state_dict}`` of the first shard's scheduler ({} without one)."""
    for s in runner.shards:
        if s.scheduler is not None:
            return {"lr_scheduler": copy.deepcopy(s.scheduler.state_dict())}
    return {}


def _restore_schedulers(runner: TaskRunner, state: Mapping[str, Any]) -> None:
    """Load the stored scheduler state into every shard's scheduler.

    Raises:
        ResumeStateError: the task has an ``lr_scheduler`` and the state none, or the
            other way round.
    """
    saved = state.get("lr_scheduler")
    schedulers = [s.scheduler for s in runner.shards if s.scheduler is not None]
    if saved is None and schedulers:
        raise ResumeStateError(
            runner.name,
            "the task has an lr_scheduler but the resume state holds no scheduler state (it "
            "was saved by a task without one); restore it into a task built the same way, "
            "or start the schedule afresh by dropping lr_scheduler",
        )
    if saved is not None and not schedulers and runner.task.lr_scheduler is None:
        raise ResumeStateError(
            runner.name,
            "the resume state holds lr_scheduler state but the task has no lr_scheduler; "
            "give the task the lr_scheduler it was trained with",
        )
    if saved is None:
        return
    for scheduler in schedulers:
        scheduler.load_state_dict(copy.deepcopy(saved))


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> qualified name`` for every parameter of ``model``; a tensor tied
    under several names (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) gets
    its first one, as ``model.named_parameters()`` lists it.

    Example:
        >>> from torch import nn
        >>> emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        >>> head.weight = emb.weight
        >>> sorted(param_names(nn.Sequential(emb, head)).values())
        ['0.weight']
    """
    return {id(p): name for name, p in model.named_parameters()}


def rebuild_optimizer_states(
    runner: TaskRunner, optimizer: Mapping[str, Any], names: dict[int, str] | None = None
) -> list[dict[str, Any] | None]:
    """Each shard's ``optimizer.state_dict()``, rebuilt from a per-parameter optimizer
    state (:func:`capture`'s ``"optimizer"``) for the parameters the runner's plan puts in
    that shard, in the order of the shard optimizer's own ``param_groups``.

    Tensors are copied: the optimizers update their state in place, and the same state
    may be restored into several runners.

    Args:
        runner: the runner whose shards' optimizers the states are for.
        optimizer: ``{"state": {name: ...}, "param_groups": [{..., "params": [name,
            ...]}]}``.
        names: :func:`param_names` of the runner's model (computed when omitted).

    Returns:
        One ``state_dict`` per shard, ``None`` for a shard without an optimizer (no
        parameters), ready for ``Optimizer.load_state_dict``.

    Raises:
        ResumeStateError: the state names parameters the model does not have, lacks some
            of the model's, or gives parameters that the task's optimizer factory puts in
            one group different hyperparameters.
    """
    model = runner.task.model
    assert isinstance(model, nn.Module)
    names = param_names(model) if names is None else names
    saved_state = optimizer.get("state") or {}
    hyper_of: dict[str, dict[str, Any]] = {}
    for group in optimizer.get("param_groups") or []:
        hyper = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        for key in group["params"]:
            hyper_of[key] = hyper
    live = {names[id(p)] for s in runner.shards if s.optimizer is not None for p in s.params}
    unknown = sorted((set(hyper_of) | set(saved_state)) - live)
    if unknown:
        raise ResumeStateError(
            runner.name,
            f"the resume state holds optimizer state for {len(unknown)} parameter(s) the "
            f"model does not have ({_listed(unknown)}). Restore it into the model it was made "
            f"with: make_task must build the same architecture for this config",
        )
    return [
        None if s.optimizer is None else _shard_state(runner, s, names, hyper_of, saved_state)
        for s in runner.shards
    ]


def _shard_state(
    runner: TaskRunner,
    shard: ShardRuntime,
    names: dict[int, str],
    hyper_of: dict[str, dict[str, Any]],
    saved_state: Mapping[str, Any],
) -> dict[str, Any]:
    """One shard optimizer's ``state_dict`` from the per-parameter state."""
    assert shard.optimizer is not None
    groups: list[dict[str, Any]] = []
    state: dict[int, Any] = {}
    index = 0
    for group in shard.optimizer.param_groups:
        keys = [names[id(p)] for p in group["params"]]
        missing = [k for k in keys if k not in hyper_of]
        if missing:
            raise ResumeStateError(
                runner.name,
                f"the resume state has no optimizer entry for {len(missing)} parameter(s) "
                f"of the model ({_listed(missing)}): it was made for another model. Restore "
                f"it into the model it was made with",
            )
        if keys:
            hyper = hyper_of[keys[0]]
            for k in keys[1:]:
                if not _same(hyper_of[k], hyper):
                    raise ResumeStateError(
                        runner.name,
                        f"parameters {keys[0]!r} and {k!r} are in one parameter group of "
                        f"shard {shard.index}'s optimizer now, but had different "
                        f"hyperparameters when the state was saved ({_diff(hyper, hyper_of[k])})"
                        f". Restore with the device_memory the state was made with, or build "
                        f"the optimizer so that parameters with different hyperparameters are "
                        f"in different groups",
                    )
            hyper = copy.deepcopy(hyper)
        else:  # an empty group: nothing saved can describe it; keep its own values
            hyper = copy.deepcopy({k: v for k, v in group.items() if k not in _NOT_HYPER})
        ids = list(range(index, index + len(keys)))
        groups.append({**hyper, "params": ids})
        for i, k in zip(ids, keys, strict=True):
            if k in saved_state:
                state[i] = _copy_tensors(saved_state[k])
        index += len(keys)
    return {"state": state, "param_groups": groups}


def _check_legacy(runner: TaskRunner, state: Mapping[str, Any]) -> None:
    if state.get("num_shards") != len(runner.shards):
        raise ResumeStateError(
            runner.name,
            f"the state was saved by an older tune_hydra, which kept optimizer state per "
            f"shard, with the model cut into {state.get('num_shards')} shard(s); it is now "
            f"cut into {len(runner.shards)}. Restore it once with the device_memory it was "
            f"made with and save again: newer states restore under any device_memory",
        )


def _restore_per_shard(runner: TaskRunner, state: Mapping[str, Any]) -> None:
    """The older layout: one optimizer ``state_dict`` and one gradient list per shard."""
    for s, sd, grads in zip(runner.shards, state["optimizers"], state["grads"], strict=True):
        if s.optimizer is not None:
            s.optimizer.load_state_dict(_copy_tensors(sd))
        for p, g in zip(s.params, grads, strict=True):
            p.grad = None if g is None else g.to(p.device, copy=True)


def from_per_shard(
    state: Mapping[str, Any], held: list[list[str]], graded: list[list[str]]
) -> dict[str, Any]:
    """``state`` of the older per-shard layout (``"optimizers"``: one optimizer
    ``state_dict`` per shard, ``"grads"``: one gradient list per shard) in this layout,
    which no longer depends on the cut.

    Args:
        state: the older state.
        held: for each shard of the cut it was saved with, the names of the parameters
            its optimizer held, in its ``state_dict``'s order.
        graded: for each shard, the names of the parameters its gradient list follows.

    Raises:
        ValueError: the lists do not match the state's (another cut, or another model);
            the message says how.

    Example:
        >>> import torch
        >>> old = {"optimizers": [{"state": {0: {"step": torch.tensor(1.0)}},
        ...                        "param_groups": [{"lr": 0.1, "params": [0]}]}],
        ...        "grads": [[None]], "iteration": 1}
        >>> new = from_per_shard(old, [["0.weight"]], [["0.weight"]])
        >>> new["optimizer"]["param_groups"], sorted(new["optimizer"]["state"])
        ([{'lr': 0.1, 'params': ['0.weight']}], ['0.weight'])
    """
    optimizers = list(state["optimizers"])
    grads = list(state.get("grads") or [[] for _ in optimizers])
    if not len(optimizers) == len(grads) == len(held) == len(graded):
        raise ValueError(
            f"it keeps {len(optimizers)} shard optimizer state(s) and {len(grads)} gradient "
            f"list(s), for a cut into {len(held)} shard(s)"
        )
    groups: list[dict[str, Any]] = []
    per_name: dict[str, Any] = {}
    param_grads: dict[str, torch.Tensor] = {}
    for shard, (sd, names, grad_names, gs) in enumerate(
        zip(optimizers, held, graded, grads, strict=True)
    ):
        if sd is not None:
            for group in sd["param_groups"]:
                ids = [int(i) for i in group["params"]]
                if any(i >= len(names) for i in ids):
                    raise ValueError(
                        f"shard {shard}'s optimizer holds {sum(map(len, sd['param_groups']))} "
                        f"parameter(s); the cut puts {len(names)} in that shard"
                    )
                hyper = {k: v for k, v in group.items() if k != "params"}
                groups.append({**hyper, "params": [names[i] for i in ids]})
            for i, st in sd["state"].items():
                per_name[names[int(i)]] = st
        if len(gs) != len(grad_names):
            raise ValueError(
                f"shard {shard} keeps {len(gs)} gradient(s); the cut puts {len(grad_names)} "
                f"parameter(s) in that shard"
            )
        for name, g in zip(grad_names, gs, strict=True):
            if g is not None:
                param_grads[name] = g
    out = {k: v for k, v in state.items() if k not in ("optimizers", "grads")}
    out["optimizer"] = {"state": per_name, "param_groups": groups}
    out["param_grads"] = param_grads
    return out


def _copy_tensors(obj: Any) -> Any:
    """``obj`` with every tensor cloned (containers rebuilt, other values shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_tensors(v) for v in obj)
    return obj


def _same(a: Any, b: Any) -> bool:
    """Equality of hyperparameter values that may hold tensors (``lr`` as a tensor)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if k not in a or k not in b or not _same(a[k], b[k])]
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys[:4])


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:4])
    return shown + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
