"""A task's exact resume point: the layout of ``TaskLoop.state()`` (what a checkpoint's
``hydra_state.pt`` holds), checked before it is loaded.

Besides the weights it holds the optimizer's state, any accumulated gradients, the task's
random stream and where in the epoch it stopped (with the epoch's starting stream, so the
data order is replayed and the batches already seen are skipped): training resumed from
it equals training that never stopped.

The state does not depend on how the model is cut: the optimizer's state is keyed by each
parameter's *qualified name* (``model.named_parameters()``; a tied tensor under its first
name), gradients likewise, so a state made under one ``device_memory`` (or device count)
restores exactly under another. The layout:

- ``"model"``: the model's ``state_dict``;
- ``"optimizer"``: ``{"state": {name: that parameter's optimizer state},
  "param_groups": [{hyperparameters..., "params": [name, ...]}, ...]}`` -- torch's own
  ``state_dict`` layout with names instead of integer ids (:func:`optimizer_state_dict`
  turns it back);
- ``"param_grads"``: ``{name: gradient}`` for the parameters that hold one (gradients
  accumulated in the middle of an accumulation group);
- ``"rng"`` (``{"cpu": state, "cuda": state or None}``), ``"epoch_rng"``, ``"seed"``,
  ``"iteration"``, ``"epoch"``, ``"batch_in_epoch"``;
- ``"num_shards"``: how many shards the model was cut into (informational);
- ``"lr_scheduler"`` (with a task ``lr_scheduler``): its ``state_dict``.

States written by older versions (``"optimizers"``: one ``state_dict`` per shard, and
``"grads"``: one list per shard) are turned into this layout by :func:`from_per_shard`,
given which parameters each shard held.

Example:
    >>> import torch
    >>> from torch import nn
    >>> import tune_hydra as th
    >>> from tune_hydra.engine import Engine
    >>> from tune_hydra.frontends.task_loop import TaskLoop
    >>> def task():
    ...     torch.manual_seed(0)
    ...     model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    ...     data = [(torch.randn(2, 4, dtype=torch.float64),
    ...              torch.randn(2, 1, dtype=torch.float64))]
    ...     return th.ModelTask(model, nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=0.1),
    ...                         data)
    >>> with Engine("cpu", max_layers_per_shard=1) as three, Engine("cpu") as one:
    ...     a, b = TaskLoop("a", task(), three, seed=0), TaskLoop("a", task(), one, seed=0)
    ...     _ = a.train_iteration()
    ...     state = a.state()
    ...     b.load_state(state)  # cut into 3 shards, restored into 1
    ...     names = sorted(b.state()["optimizer"]["state"])
    ...     len(a.cut()), len(b.cut()), names == sorted(state["optimizer"]["state"])
    (3, 1, True)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.exceptions import ResumeStateError

if TYPE_CHECKING:
    from tune_hydra.engine.task import ModelTask

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


def model_problem(model: nn.Module, state: Mapping[str, Any]) -> tuple[str, str] | None:
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


def optimizer_state_dict(
    name: str, model: nn.Module, optimizer: torch.optim.Optimizer, saved: Any
) -> dict[str, Any]:
    """Task ``name``'s ``optimizer``'s ``state_dict`` (torch's layout) from a state's
    per-parameter one (``model``: its parameters' names)."""
    if not isinstance(saved, Mapping):
        raise ResumeStateError(
            name,
            "the resume state holds no optimizer state (no 'optimizer' entry): restore "
            "from a state a task or engine made",
        )
    names = param_names(model)
    hyper_of: dict[str, dict[str, Any]] = {}
    for group in saved.get("param_groups") or []:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for key in group["params"]:
            hyper_of[key] = hyper
    saved_state = saved.get("state") or {}
    groups: list[dict[str, Any]] = []
    out_state: dict[int, Any] = {}
    index = 0
    for group in optimizer.param_groups:
        keys = [names[id(p)] for p in group["params"]]
        missing = [k for k in keys if k not in hyper_of]
        if missing:
            raise ResumeStateError(
                name,
                f"the resume state has no optimizer entry for {len(missing)} "
                f"parameter(s) of the model ({', '.join(map(repr, missing[:4]))}): it was "
                f"made for another model. Restore it into the model it was made with",
            )
        for k in keys[1:]:  # one group now: the saved values must agree
            if not _same(hyper_of[k], hyper_of[keys[0]]):
                raise ResumeStateError(
                    name,
                    f"parameters {keys[0]!r} and {k!r} are in one parameter group of the "
                    f"optimizer now, but had different hyperparameters when the state was "
                    f"saved ({_diff(hyper_of[keys[0]], hyper_of[k])}). Build the optimizer "
                    f"so that parameters with different hyperparameters are in different "
                    f"groups, as when the state was made",
                )
        hyper = copy.deepcopy(hyper_of[keys[0]]) if keys else {}
        ids = list(range(index, index + len(keys)))
        groups.append({**group, **hyper, "params": ids})
        for i, key in zip(ids, keys, strict=True):
            if key in saved_state:
                out_state[i] = _copy_tensors(saved_state[key])
        index += len(keys)
    known = {names[id(p)] for g in optimizer.param_groups for p in g["params"]}
    unknown = sorted((set(hyper_of) | set(saved_state)) - known)
    if unknown:
        raise ResumeStateError(
            name,
            f"the resume state holds optimizer state for {len(unknown)} parameter(s) the "
            f"model does not have ({', '.join(map(repr, unknown[:4]))}): restore it into "
            f"the model it was made with",
        )
    return {"state": out_state, "param_groups": groups}


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


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
