"""A ``ModelTask`` trained as a ``th.shard`` loop: :class:`TaskLoop`.

A task factory's task is the plain training loop, written once: the loop of
:func:`~tune_hydra.engine.reference.train_plain` (``zero_grad`` at each accumulation
group's start, forward, loss, ``(loss / k).backward()``, clipping, ``step`` and the
scheduler's ``step`` at the group's end and at the epoch's; evaluation under ``eval()``
and ``no_grad``), with the model and its optimizer sharded by ``th.shard``. So a task
trains on the runtime users' own loops train on (one shard op, stepping, random streams
and checks for both), and equals plain PyTorch exactly as they do.

Its random numbers (a shuffling ``DataLoader``, dropout) come from a generator of its
own, seeded with the task's seed as ``torch.manual_seed(seed)`` seeds the global one, on
whichever thread runs an iteration (see
:func:`~tune_hydra.engine.registration.factory.use_generator`).

Its resume state (:meth:`TaskLoop.state`) has the layout of
:mod:`tune_hydra.engine.runtime.resume` (weights, optimizer state by parameter name,
gradients of a group in progress, the random stream, the position in the data), which
does not depend on how the model is cut.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import math
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.engine.registration.factory import use_generator
from tune_hydra.engine.registration.partition import build_optimizer
from tune_hydra.engine.registration.registry import check_keyword_batch, check_trainable
from tune_hydra.engine.runtime import resume
from tune_hydra.engine.runtime.boundary import split_batch, to_device
from tune_hydra.engine.runtime.checks import (
    backward_mismatch,
    batch_signature,
    checked_loss,
    data_mismatch,
)
from tune_hydra.engine.runtime.metrics import MetricTotals, add_metrics, build_scheduler
from tune_hydra.engine.task import describe, model_layers
from tune_hydra.exceptions import (
    AlreadyShardedError,
    EmptyDataError,
    InvalidTaskError,
    NonFiniteLossError,
    ResumeStateError,
    SharedModelError,
)
from tune_hydra.options import check_seed, check_task_options

if TYPE_CHECKING:
    from tune_hydra.engine.engine import Engine
    from tune_hydra.engine.task import ModelTask

_END = object()


class TaskLoop:
    """One task's training, iteration by iteration, as a ``th.shard`` loop on ``engine``.

    Args:
        name: the task's name (in errors).
        task: the task; its model and an optimizer over its trainable parameters are
            sharded here.
        engine: the engine its ops run on.
        seed: the seed of its random stream when the task has none (``ModelTask.seed``
            wins); ``None``: ``torch.initial_seed()``.
        accumulate_steps: batches per optimizer step.
        max_grad_norm: clip the gradients' total norm to this before each step.
        precision: ``"bf16"``: forward and loss under bf16 autocast; ``None`` / ``"fp32"``:
            in the model's dtype.
        iteration_batches: batches of one iteration (going on into the next epoch when
            the data ends first); ``None``: an iteration is an epoch.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import tune_hydra as th
        >>> task = th.ModelTask(nn.Sequential(nn.Linear(2, 1)), nn.MSELoss(),
        ...                     lambda p: torch.optim.SGD(p, lr=0.1),
        ...                     [(torch.ones(1, 2), torch.zeros(1, 1))])
        >>> with th.Engine(devices=["cpu"]) as engine:
        ...     loop = TaskLoop("a", task, engine, seed=0)
        ...     sorted(loop.train_iteration())[:4]
        ['batches', 'bytes_spilled', 'device_time_s', 'epoch']
    """

    def __init__(
        self,
        name: str,
        task: ModelTask,
        engine: Engine,
        *,
        seed: int | None = None,
        accumulate_steps: int = 1,
        max_grad_norm: float | None = None,
        precision: str | None = None,
        iteration_batches: int | None = None,
    ) -> None:
        from tune_hydra.frontends.shard import shard

        self.name = name
        self.task = task
        self.engine = engine
        where = f"task {name!r}"
        task_seed = check_seed(task.seed, option="ModelTask.seed", where=where)
        options = check_task_options(
            seed=seed,
            max_grad_norm=max_grad_norm,
            accumulate_steps=accumulate_steps,
            precision=precision,
            iteration_batches=iteration_batches,
            where=where,
        )
        seed = task_seed if task_seed is not None else options["seed"]
        self.seed = torch.initial_seed() if seed is None else seed
        self.accumulate_steps: int = options["accumulate_steps"]
        self.max_grad_norm: float | None = options["max_grad_norm"]
        self.precision: str | None = options["precision"]
        self.iteration_batches: int | None = options["iteration_batches"]
        self.generator = torch.Generator().manual_seed(self.seed)
        self.iteration = 0  # iterations finished
        self.epoch = 0  # epochs finished
        self.batch_in_epoch = 0  # train batches of the current epoch trained on
        self.history: list[dict[str, Any]] = []
        self._train_iter: Iterator[Any] | None = None
        self._epoch_rng = self.generator.get_state()  # where this epoch's data order began
        self._replay: tuple[torch.Tensor, int] | None = None  # resuming mid-epoch
        self._training = threading.Lock()  # one thread trains it at a time
        model = task.model
        assert isinstance(model, nn.Module)
        _check_not_sharded(name, model)
        # Refused before anything is built, naming the task: what cannot be cut, and a
        # model with nothing to train.
        model_layers(model, name)
        check_trainable(name, model)
        self._probed: tuple[Any, str] | None = None  # the first batch's inputs, described
        model.train()  # plain training's model.train(): a model given in eval mode trains
        params = list(model.parameters())  # as train_plain: frozen ones too (unfreezing)
        with use_generator(self.generator):
            optimizer = build_optimizer(task.optimizer, params, name, "the model's parameters")
            try:
                self.model, self.optimizer = shard(model, optimizer, engine=engine, name=name)
            except AlreadyShardedError:  # another task's loop took it meanwhile
                _check_not_sharded(name, model)
                raise
        self.scheduler = (
            build_scheduler(task.lr_scheduler, self.optimizer, name, "the model's optimizer")
            if task.lr_scheduler is not None
            else None
        )

    # -- training -----------------------------------------------------------------------

    def start(self, iterations: int = 1) -> concurrent.futures.Future[list[dict[str, Any]]]:
        """Train ``iterations`` iterations on a thread of its own (several loops of one
        engine then train at once); the future gets their results, or the first error.

        Raises:
            InvalidTaskError: ``iterations`` is not an int >= 1.
        """
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise InvalidTaskError(f"task {self.name!r}: iterations must be an int >= 1")
        future: concurrent.futures.Future[list[dict[str, Any]]] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                results = [self.train_iteration() for _ in range(iterations)]
            except BaseException as err:  # the caller's future gets it
                future.set_exception(err)
            else:
                future.set_result(results)

        threading.Thread(target=run, name=f"hydra-task-{self.name}", daemon=True).start()
        return future

    def train_iteration(self) -> dict[str, Any]:
        """Train one iteration (an epoch, or ``iteration_batches`` batches), then
        evaluate on ``eval_data``; returns its result (also kept in :attr:`history`).

        Raises:
            EmptyDataError: ``train_data`` (or ``eval_data``) yielded no batch.
            InvalidTaskError: another thread is training this loop.
            Exception: whatever the model, the loss or a metric raised.
        """
        with self._alone():
            return self._iteration()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """Train, or read or load the state, on one thread at a time: a state read while
        another thread trains would mix two steps.

        Raises:
            InvalidTaskError: another thread is training the loop.
        """
        if not self._training.acquire(blocking=False):
            raise InvalidTaskError(
                f"task {self.name!r}: another thread is training it; wait for its "
                f"iteration (the future of start()) first"
            )
        try:
            yield
        finally:
            self._training.release()

    def _iteration(self) -> dict[str, Any]:
        with use_generator(self.generator):
            losses = self._train_batches()
            self.iteration += 1
            result: dict[str, Any] = {
                "loss": sum(losses) / len(losses) if losses else math.nan,
                "iteration": self.iteration,
                "epoch": self.epoch,
                "batches": len(losses),
            }
            if self.task.eval_data is not None:
                self._evaluate(result)
        from tune_hydra.frontends.shard import shard_count

        loop = self.runner
        result["num_shards"] = shard_count(self.model)
        result["device_time_s"] = loop.device_time
        result["bytes_spilled"] = sum(s.moved_total for s in loop.stores)
        self.history.append(result)
        return result

    def _train_batches(self) -> list[float]:
        from tune_hydra.frontends.shard import forward_loss

        k = self.accumulate_steps
        limit = self.iteration_batches
        losses: list[float] = []
        while limit is None or len(losses) < limit:
            batch = self._next_batch()
            if batch is _END:
                if self.batch_in_epoch == 0:
                    raise EmptyDataError(
                        f"task {self.name!r}: train_data yielded no batch in epoch "
                        f"{self.epoch}; give it at least one (inputs, targets) pair"
                    )
                if self.batch_in_epoch % k:  # the epoch's last group, partial, steps too
                    self._step()
                self.epoch += 1
                self.batch_in_epoch = 0
                if limit is None:
                    break
                continue
            x, y = split_batch(batch, self.name)
            if self._probed is None:
                check_keyword_batch(self.name, self.task.model, x)  # type: ignore[arg-type]
            if self.batch_in_epoch % k == 0:
                self.optimizer.zero_grad()
            where = f"batch {self.batch_in_epoch} of epoch {self.epoch} of train_data"

            seen: list[Any] = []  # the output and target, for an error of the backward

            def loss_of(
                out: Any, device: torch.device, y: Any = y, where: str = where, seen: Any = seen
            ) -> Any:
                target = to_device(y, device)
                seen[:] = [out, target]
                return checked_loss(self.name, self.task, out, target, where, True)

            args, kwargs = ((), dict(x)) if isinstance(x, Mapping) else ((x,), {})
            try:
                with self._autocast():  # the loss's backward runs outside it, as plain's
                    loss = forward_loss(self.model, args, kwargs, loss_of, k)
            except Exception as err:
                blamed = self._blamed(err, x, where, seen)
                if blamed is err:
                    raise
                raise blamed from err
            finally:
                seen.clear()
            if self._probed is None:
                self._probed = (batch_signature(x), describe(x))
            value = loss.item()
            if not math.isfinite(value):
                raise NonFiniteLossError(self.name, self.epoch, self.batch_in_epoch, value)
            losses.append(value)
            self.batch_in_epoch += 1
            if self.batch_in_epoch % k == 0:
                self._step()
        return losses

    def cut(self) -> list[list[str]]:
        """The layer names of each shard; the model is cut now, on the first train batch,
        if no iteration cut it yet (as the first would: nothing is trained, and the
        task's random stream is left where it was).

        Raises:
            EmptyDataError: ``train_data`` yielded no batch.
            InvalidModelError, DataMismatchError: what the first forward's cut raises.
        """
        loop = self.runner
        if loop is None:
            from tune_hydra.frontends.shard import cut_now

            start = self.generator.get_state()
            try:
                with use_generator(self.generator):
                    batch = next(iter(self.task.train_data), _END)
                    if batch is _END:
                        raise EmptyDataError(
                            f"task {self.name!r}: train_data yielded no batch; give it at "
                            f"least one (inputs, targets) pair"
                        )
                    x, _ = split_batch(batch, self.name)
                    check_keyword_batch(self.name, self.task.model, x)  # type: ignore[arg-type]
                    args, kwargs = ((), dict(x)) if isinstance(x, Mapping) else ((x,), {})
                    with self._autocast():  # as the first forward cuts it
                        loop = cut_now(self.model, args, kwargs)
            finally:
                self.generator.set_state(start)
        return [list(spec.layer_names) for spec in loop.plan.shards]

    def ops_per_iteration(self) -> float | None:
        """The engine ops of one iteration once cut (a train batch is one op, an eval
        batch one per shard, the loop's first clip one per shard: later clips take the
        norms the backward ops took); None for data without a length, or before the
        cut."""
        loop = self.runner
        try:
            batches = len(self.task.train_data)  # type: ignore[arg-type]
            evals = 0 if self.task.eval_data is None else len(self.task.eval_data)  # type: ignore[arg-type]
        except TypeError:
            return None
        if loop is None:
            return None
        if self.iteration_batches is not None:
            batches = self.iteration_batches
        shards = len(loop.shards)
        norms = shards if self.max_grad_norm is not None and not loop.optim.clips else 0
        return float(batches + evals * shards + norms)

    def _next_batch(self) -> Any:
        """The epoch's next train batch, or ``_END`` when its data ended."""
        if self._train_iter is None:
            if self._replay is not None:  # resumed mid-epoch: that epoch's order, skipped
                start, skip = self._replay
                self._replay = None
                now = self.generator.get_state()
                self.generator.set_state(start)
                self._train_iter = iter(self.task.train_data)
                for done in range(skip):
                    if next(self._train_iter, _END) is _END:
                        raise ResumeStateError(
                            self.name,
                            f"the resume state's 'batch_in_epoch' is {skip}, but train_data "
                            f"yielded only {done} batch(es) this epoch: the state was saved "
                            f"with other data, or it is damaged. Restore it into a task with "
                            f"the data it was trained on, or start the trial afresh",
                        )
                self.generator.set_state(now)
                self._epoch_rng = start
            else:
                self._epoch_rng = self.generator.get_state()
                self._train_iter = iter(self.task.train_data)
        batch = next(self._train_iter, _END)
        if batch is _END:
            self._train_iter = None
        return batch

    def _step(self) -> None:
        if self.max_grad_norm is not None:
            runner = self.runner
            if runner is None:  # not cut yet (resumed at the end of a group)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            else:  # on the shards' devices, not the whole state in host memory
                runner.clip_grad_norm(self.max_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def _evaluate(self, result: dict[str, Any]) -> None:
        self.model.eval()
        totals = MetricTotals(self.task.metrics)
        losses: list[float] = []
        try:
            with torch.no_grad(), self._autocast():
                for e, batch in enumerate(self.task.eval_data or ()):
                    x, y = split_batch(batch, self.name)
                    where = f"batch {e} of eval_data (after epoch {self.epoch})"
                    try:
                        out = self._call(x)
                    except Exception as err:
                        blamed = self._blamed(err, x, where, [])
                        if blamed is err:
                            raise
                        raise blamed from err
                    loss = checked_loss(self.name, self.task, out, y, where, False)
                    losses.append(float(loss.item()))
                    if totals.metrics:
                        totals.add(out, y, self.name, f"batch {e} of eval_data")
        finally:
            self.model.train()
        if not losses:
            raise EmptyDataError(f"task {self.name!r}: eval_data yielded no batch")
        result["val_loss"] = sum(losses) / len(losses)
        add_metrics(result, totals.means())  # a metric named "loss" takes that key

    def _blamed(self, err: Exception, x: Any, where: str, seen: list[Any]) -> Exception:
        """``err``, raised while training or evaluating on the batch ``x``, as a
        :class:`~tune_hydra.exceptions.DataMismatchError` when the data is at fault (a
        first layer that cannot take it, a batch unlike the first one, targets that do not
        fit the output), else ``err`` itself."""
        runner = self.runner
        if runner is not None:
            first = runner.plan.shards[0]
            layers = list(zip(first.layer_names, runner.shards[0].module, strict=True))
            found = data_mismatch(self.name, layers, x, err, where, self._probed)
            if found is not None:
                return found
        if seen:  # the loss was computed: its backward raised
            found = backward_mismatch(self.name, err, seen[0], seen[1], where)
            if found is not None:
                return found
        return err

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(self.engine.devices[0].type, dtype=torch.bfloat16)

    def _call(self, inputs: Any) -> Any:
        """``model(**inputs)`` for a dict batch (a Hugging Face collator's), else
        ``model(inputs)``."""
        return self.model(**inputs) if isinstance(inputs, Mapping) else self.model(inputs)

    @property
    def runner(self) -> Any:
        """The engine's runner of this loop (a ``LoopRunner``), None before the cut."""
        return self.model.__dict__["_th_shard"].loop

    # -- resume state -------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything needed to resume exactly, between iterations (tensors copied, on
        the CPU), in :mod:`~tune_hydra.engine.runtime.resume`'s layout.

        Raises:
            InvalidTaskError: another thread is training the loop.
        """
        with self._alone():
            return self._state()

    def _state(self) -> dict[str, Any]:
        model_state = self.model.state_dict()  # brings every shard's state home first
        names = resume.param_names(self.model)
        saved = self.optimizer.state_dict()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        groups = []
        for live, group in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            hyper = {k: copy.deepcopy(v) for k, v in group.items() if k not in ("params",)}
            groups.append({**hyper, "params": [names[id(p)] for p in live["params"]]})
        loop = self.runner
        cuda = None if loop is None else loop.random.stream.cuda
        state: dict[str, Any] = {
            "model": {k: v.detach().clone() for k, v in model_state.items()},
            "optimizer": {
                "state": {
                    names[id(params[i])]: copy.deepcopy(st) for i, st in saved["state"].items()
                },
                "param_groups": groups,
            },
            "param_grads": {
                names[id(p)]: p.grad.detach().clone()
                for p in self.model.parameters()
                if p.grad is not None
            },
            "rng": {
                "cpu": self.generator.get_state(),
                "cuda": None if cuda is None else cuda.clone(),
            },
            "epoch_rng": self._epoch_rng.clone(),
            "seed": self.seed,
            "iteration": self.iteration,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "num_shards": 0 if loop is None else len(loop.shards),
        }
        if self.scheduler is not None:
            state["lr_scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        return state

    def load_state(self, state: Mapping[str, Any], cut: list[list[str]] | None = None) -> None:
        """Go on from :meth:`state`'s output (of this task, or of a ``ModelTask`` the
        engine trained: the same layout), before or between iterations.

        A state of the older per-shard layout (one optimizer state per shard) loads too,
        under any cut, given ``cut``: the layer names of each shard of the cut it was
        saved with (a checkpoint's manifest lists them); without it, only into a model
        cut into as many shards (the model is cut now if it was not yet).

        Raises:
            ResumeStateError: the state is damaged, of another model, of the per-shard
                layout under an unknown cut, or its scheduler state does not match the
                task's.
            InvalidTaskError: another thread is training the loop.
        """
        with self._alone():
            self._load_state(state, cut)

    def _load_state(self, state: Mapping[str, Any], cut: list[list[str]] | None) -> None:
        resume.refuse(
            self.name, resume.state_problem(state) or resume.position_problem(self.task, state)
        )
        if "optimizers" in state:
            state = _from_per_shard(self, state, cut)
        resume.refuse(self.name, resume.model_problem(self.model, state), fits=True)
        sd = resume.optimizer_state_dict(
            self.name, self.model, self.optimizer, state.get("optimizer")
        )
        saved_sched = state.get("lr_scheduler")
        if (saved_sched is None) != (self.scheduler is None):
            raise ResumeStateError(
                self.name,
                "the resume state's scheduler state does not match the task: "
                + (
                    "the task has an lr_scheduler and the state none"
                    if saved_sched is None
                    else "the state holds lr_scheduler state and the task has no lr_scheduler"
                )
                + "; restore it into a task built the way it was trained",
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(sd)
        grads = state.get("param_grads") or {}
        names = resume.param_names(self.model)
        for p in self.model.parameters():  # at home (synced), marked written
            g = grads.get(names[id(p)])
            p.grad = None if g is None else g.detach().clone()
        if self.scheduler is not None and saved_sched is not None:
            self.scheduler.load_state_dict(copy.deepcopy(saved_sched))
        self.generator.set_state(state["rng"]["cpu"].clone())
        loop = self.runner
        cuda = state["rng"].get("cuda")
        if loop is not None and cuda is not None:
            loop.random.stream.cuda = cuda.clone()
        self.iteration = state["iteration"]
        self.epoch = state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self._train_iter = None
        self._epoch_rng = state["epoch_rng"].clone()
        self._replay = (self._epoch_rng, self.batch_in_epoch) if self.batch_in_epoch else None

    def close(self) -> None:
        """Leave the engine (``th.unshard``): the model keeps its trained weights, on the
        CPU, as the task's plain model."""
        from tune_hydra.frontends.shard import unshard

        unshard(self.model)


def _check_not_sharded(name: str, model: nn.Module) -> None:
    """Refuse a model another task's loop trains (a module-level model that every factory
    call returns).

    Raises:
        SharedModelError: naming that task and the model's trained tensors.
    """
    state = model.__dict__.get("_th_shard")
    if state is None:
        return
    owner = state.name or "a th.shard loop"
    shared = [(n, n) for n, p in nn.Module.named_parameters(model) if p.requires_grad]
    shared += [(n, n) for n, _ in nn.Module.named_buffers(model)]
    raise SharedModelError(name, owner, shared or [("<the whole model>",) * 2])


def _from_per_shard(
    loop: TaskLoop, state: Mapping[str, Any], cut: list[list[str]] | None
) -> dict[str, Any]:
    """A state of the older per-shard layout in this one: which parameters each
    shard's optimizer held is worked out from the cut it was saved with, as the
    runner of that version assigned them (a tied parameter to its first user)."""
    own = loop.cut()
    saved = own if cut is None else [list(names) for names in cut]
    runner = loop.runner
    layers: dict[str, nn.Module] = {}
    for spec, shard in zip(runner.plan.shards, runner.shards, strict=True):
        layers.update(zip(spec.layer_names, shard.module, strict=True))
    unknown = [n for names in saved for n in names if n not in layers]
    if unknown:
        raise ResumeStateError(
            loop.name,
            f"the resume state keeps optimizer state per shard (an older tune_hydra wrote "
            f"it) of a cut naming layers this model does not have "
            f"({', '.join(map(repr, unknown[:4]))}): restore it into the model it was "
            f"made with",
        )
    from tune_hydra.engine.registration.shared import SharedParams

    parts = [nn.Sequential(*(layers[n] for n in names)) for names in saved]
    shared = SharedParams(parts)
    names = resume.param_names(loop.model)
    held: list[list[str]] = []
    graded: list[list[str]] = []
    for i, part in enumerate(parts):
        params = shared.steps(i, part)
        graded.append([names[id(p)] for p in params])
        # The optimizer's own order of them (a factory may group them).
        opt = build_optimizer(loop.task.optimizer, params, loop.name, "a shard") if params else None
        held.append(
            [] if opt is None else [names[id(p)] for g in opt.param_groups for p in g["params"]]
        )
    try:
        return resume.from_per_shard(state, held, graded)
    except ValueError as err:
        how = "" if cut is not None else "; give the cut it was saved with (its manifest's)"
        raise ResumeStateError(
            loop.name,
            f"the resume state keeps optimizer state per shard (an older tune_hydra wrote "
            f"it), which does not fit this model's parameters under its cut: {err}{how}",
        ) from None
