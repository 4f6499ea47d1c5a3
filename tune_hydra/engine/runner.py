"""One task's life in the engine: the order of its shard operations and how each runs.

:class:`TaskRunner` produces the task's operations one at a time (a generator resumed
after each operation completes) and executes them on whatever device the scheduler
picked. Training is arranged to equal plain PyTorch exactly:

- forward keeps each shard's input (and the RNG state before it); the last shard's visit
  computes the loss and its own backward; every other shard's backward re-runs its
  forward from the saved input with the saved RNG state (same dropout masks) and its
  buffers restored afterwards (BatchNorm statistics are updated once, as in plain
  training) -- or, with ``recompute=False``, keeps the forward's graph instead;
- with ``max_grad_norm`` the global norm over all shards is known only after the first
  shard's backward, so the other shards' steps are deferred to their next visit;
- the task's RNG stream is installed in torch's global generators around each operation.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.engine import resume, rng
from tune_hydra.engine.boundary import (
    SavedInput,
    backward,
    clone,
    detach,
    grads_of,
    leaves,
    park,
    split_batch,
    to_device,
    versions,
)
from tune_hydra.engine.metrics import MetricTotals, build_scheduler
from tune_hydra.engine.partition import ShardPlan, build_optimizer, layer_error
from tune_hydra.engine.spill import ShardStore
from tune_hydra.engine.task import ModelTask, OwnedTensors, describe, mismatch_hint, owned_tensors
from tune_hydra.exceptions import (
    DataMismatchError,
    EmptyDataError,
    InvalidLossError,
    InvalidModelError,
    NonFiniteLossError,
    TuneHydraError,
)


@dataclass
class TrainOptions:
    """Per-task training options (see ``train_models``)."""

    seed: int = 0
    max_grad_norm: float | None = None
    accumulate_steps: int = 1
    precision: str | None = None
    iteration_batches: int | None = None
    recompute: bool = False


@dataclass
class ShardRuntime:
    """A shard's live objects inside the engine."""

    index: int
    module: nn.Sequential
    optimizer: torch.optim.Optimizer | None  # None: the shard has no parameters
    store: ShardStore
    # Whether a visit drew from the CPU / the GPU generator (None: not seen yet). A shard
    # that never drew skips installing that generator, and the CPU lock.
    cpu_rng: bool | None = None
    # Whether its first layer writes into its input in place (ReLU(inplace=True) right
    # after a cut), from the layer probe; None: not known, the first visit computes on a
    # clone and finds out. A shard that writes always computes on a clone.
    mutates_input: bool | None = None
    cuda_rng: bool | None = None
    pending_step: bool = False
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    # The task's lr_scheduler over this shard's optimizer, stepped after each of its steps.
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return self.store.params


class TaskRunner:
    """Produces and executes one task's shard operations."""

    def __init__(
        self,
        name: str,
        task: ModelTask,
        plan: ShardPlan,
        layers: list[tuple[str, nn.Module]],
        options: TrainOptions,
        *,
        order: int = 0,
        pin: bool = False,
    ) -> None:
        self.name = name
        self.task = task
        self.plan = plan
        self.options = options
        self.order = order
        self.shards: list[ShardRuntime] = []
        seen: set[int] = set()
        for spec in plan.shards:
            module = nn.Sequential(*(m for _, m in layers[spec.start : spec.stop]))
            params = [p for p in module.parameters()]
            for p in params:
                if id(p) in seen:
                    raise _tied_error(spec.layer_names)
            seen.update(id(p) for p in params)
            # A shard of parameter-free layers (ReLU, Dropout alone) has nothing to step;
            # torch optimizers refuse an empty parameter list.
            what = f"the parameters of shard {spec.index} (layers {', '.join(spec.layer_names)})"
            opt = build_optimizer(task.optimizer, params, name, what) if params else None
            sched = (
                build_scheduler(task.lr_scheduler, opt, name, f"the optimizer of {what}")
                if opt is not None and task.lr_scheduler is not None
                else None
            )
            self.shards.append(
                ShardRuntime(
                    spec.index,
                    module,
                    opt,
                    ShardStore(
                        [module],
                        opt,
                        pin=pin,
                        name=(name, spec.index),
                        footprint=(spec.state_bytes, spec.activation_bytes),
                    ),
                    mutates_input=spec.writes_input,
                    scheduler=sched,
                )
            )
        self.rng = rng.seeded_state(options.seed)
        self.iteration = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.granted = 0
        self.history: list[dict[str, Any]] = []
        self.device_time = 0.0
        self._autocast_dtype = torch.bfloat16 if options.precision == "bf16" else None
        # Per-batch state.
        self._train_iter: Iterator[Any] | None = None
        self._eval_iter: Iterator[Any] | None = None
        self._exhausted = False
        # Per micro-batch of the visit's group (one entry unless visits are grouped):
        self._targets: list[Any] = []
        self._inputs: dict[int, list[Any]] = {}
        self._rng_at: dict[int, list[rng.RngState | None]] = {}
        self._outputs: dict[int, list[Any]] = {}
        self._carries: list[Any] = []  # activations (forward) or gradients (backward)
        self._carry: Any = None  # the eval batch's activation
        # Held while an op runs; parking the boundary tensors (from another thread) only
        # happens while the task waits, never under a running op.
        self._carry_lock = threading.Lock()
        self._park_lock = threading.Lock()
        self._parked = False  # boundary tensors moved to host memory since the last op
        self._target: Any = None  # the eval batch's target
        self._on_gpu = False
        self._losses: list[float] = []
        self._eval_losses: list[float] = []
        self._metric_totals = MetricTotals(task.metrics)
        self._epoch_rng = rng.RngState(self.rng.cpu.clone())
        self._resume_epoch_rng = self._epoch_rng
        self._skip = 0
        self._gen: Generator[Op | None, None, None] = self._life()
        self.current: Op | None = next(self._gen)
        self.on_iteration: Callable[[dict[str, Any]], None] | None = None
        # Set by the engine when a batch's kept graphs are reserved on a copying device
        # (tune_hydra.engine.kept): one micro-batch's graphs at a time, as on a GPU.
        self.budgeted_graphs = False
        # The signature and description of the batch probed at add_task (which the model
        # took; see note_probe): a later batch that fails unlike it is a data mismatch.
        self.probed: tuple[Any, str] | None = None

    def note_probe(self, inputs: Any) -> None:
        """Remember the structure, dtypes and shapes of the inputs the model was probed
        with (not the tensors: a batch can be large)."""
        self.probed = (_signature(inputs), describe(inputs))

    def owned_tensors(self) -> OwnedTensors:
        """The parameters and buffers this task trains, as they are now: the model's live
        tensors and, for shards on a device, their host copies (see
        :func:`~tune_hydra.engine.task.owned_tensors`)."""
        host: list[tuple[Any, torch.Tensor]] = []
        for s in self.shards:
            store = s.store
            with store.lock:  # a promotion may be adding host buffers right now
                items = list(store._host.items())
            for key, t in items:
                if key[0] == "p":
                    host.append((store.params[key[1]], t))
                elif key[0] == "b":
                    host.append((store.buffer_slots[key[1]], t))
        return owned_tensors(self.task.model, host)  # type: ignore[arg-type]

    # -- the operation sequence ---------------------------------------------------------

    def advance(self) -> Op | None:
        """Move to the next operation (after the current one completed, or a grant)."""
        self.current = next(self._gen)
        return self.current

    def _life(self) -> Generator[Op | None, None, None]:
        n = len(self.shards)
        while True:
            while self.granted == 0:
                yield None
            it = self.iteration
            self._losses = []
            done_batches = 0
            limit = self.options.iteration_batches
            while limit is None or done_batches < limit:
                b = self.batch_in_epoch
                want = self._group_count(b, None if limit is None else limit - done_batches)
                yield Op(self.name, OpKind.LAST if n == 1 else OpKind.FORWARD, 0, it, b, want)
                if self._exhausted:
                    if b == 0:
                        raise EmptyDataError(
                            f"task {self.name!r}: train_data yielded no batch in epoch "
                            f"{self.epoch}; give it at least one (inputs, targets) pair"
                        )
                    self._end_epoch()
                    if limit is not None:  # an iteration of N batches runs on into the next epoch
                        continue
                    break
                m = len(self._carries)  # fewer than wanted at the end of the data
                for i in range(1, n - 1):
                    yield Op(self.name, OpKind.FORWARD, i, it, b, m)
                if n > 1:
                    yield Op(self.name, OpKind.LAST, n - 1, it, b, m)
                for i in range(n - 2, -1, -1):
                    yield Op(self.name, OpKind.BACKWARD, i, it, b, m)
                self.batch_in_epoch += m
                done_batches += m
            if self.task.eval_data is not None:
                self._eval_losses = []
                self._metric_totals = MetricTotals(self.task.metrics)
                e = 0
                while True:
                    yield Op(self.name, OpKind.EVAL, 0, it, e)
                    if self._eval_iter is None:
                        break
                    for i in range(1, n):
                        yield Op(self.name, OpKind.EVAL, i, it, e)
                    e += 1
            for s in self.shards:
                if s.pending_step:
                    yield Op(self.name, OpKind.STEP, s.index, it, -1)
            self._finish_iteration()

    def carry_bytes(self, device: torch.device) -> int:
        """Bytes of the boundary tensors (activations or gradients) waiting on ``device``
        for this task's next op (0 once parked in host memory)."""
        if self._parked:
            return 0
        total = 0
        for t in leaves([*self._carries, self._carry]):
            if t.device == device:
                total += t.numel() * t.element_size()
        return total

    def park_carries(self, device: torch.device, stream: Any = None) -> int:
        """Move the boundary tensors waiting on ``device`` to host memory (pinned, from a
        GPU), so that other tasks' ops can use the room; the next op copies them back.

        Called from a worker thread while the task waits. Returns the bytes moved: 0 when
        the task's op is running (its inputs are in use) or nothing waits on ``device``.
        On a CPU device (``copy_on_cpu``) the copy is a clone, which is the same logic.
        """
        # Another thread parking them: wait until they are off the device (its caller
        # counts them as freed; this one must not go on while they still occupy it).
        with self._park_lock:
            if not self._carry_lock.acquire(blocking=False):
                return 0
            try:
                if self._parked:
                    return 0
                parked, moved = park([*self._carries, self._carry], device, stream)
                self._carries, self._carry = parked[:-1], parked[-1]
                self._parked = moved > 0
                return moved
            finally:
                self._carry_lock.release()

    def drop_batch(self) -> None:
        """Let go of the batch in progress (its kept graphs, saved inputs and boundary
        tensors): the task failed or was cancelled, and will not go on with it."""
        with self._carry_lock:
            self._inputs, self._outputs, self._rng_at = {}, {}, {}
            self._carries, self._carry, self._targets = [], None, []

    def next_shard(self, op: Op) -> int | None:
        """The shard the task's op after ``op`` will most likely use (for prefetching it
        while ``op`` runs); ``None`` when that is ``op``'s own shard or unknown."""
        n = len(self.shards)
        if op.kind is OpKind.FORWARD or (op.kind is OpKind.EVAL and op.shard < n - 1):
            return op.shard + 1
        if op.kind is OpKind.LAST and n > 1:
            return n - 2
        if op.kind is OpKind.BACKWARD and op.shard > 0:
            return op.shard - 1
        return None  # B0 is followed by F0 (the same shard) or the iteration's end

    def _group_count(self, b: int, left: int | None) -> int:
        """Micro-batches the next visits run: the rest of the accumulation group when that
        keeps plain training's order of random draws (no shard draws any), else 1."""
        k = self.options.accumulate_steps
        if k == 1:
            return 1
        rng_free = all(
            s.cpu_rng is False and (s.cuda_rng is False or not self._on_gpu) for s in self.shards
        )
        # Kept graphs of a whole group would sit in device memory the plan did not budget.
        kept = not self.options.recompute and (self._on_gpu or self.budgeted_graphs)
        if not rng_free or kept:
            return 1
        count = k - b % k
        return count if left is None else max(1, min(count, left))

    def _end_epoch(self) -> None:
        k = self.options.accumulate_steps
        if self.batch_in_epoch % k != 0:  # a partial last group still steps
            self._schedule_steps()
        self._train_iter = None
        self._exhausted = False
        self.epoch += 1
        self.batch_in_epoch = 0

    def _finish_iteration(self) -> None:
        result: dict[str, Any] = {
            "loss": sum(self._losses) / len(self._losses) if self._losses else math.nan,
            "num_shards": len(self.shards),
            "iteration": self.iteration + 1,
            "epoch": self.epoch,
            "batches": len(self._losses),
            "device_time_s": self.device_time,
            "bytes_spilled": sum(s.store.moved_total for s in self.shards),
        }
        if self.task.eval_data is not None:
            if not self._eval_losses:
                raise EmptyDataError(f"task {self.name!r}: eval_data yielded no batch")
            result["val_loss"] = sum(self._eval_losses) / len(self._eval_losses)
            result.update(self._metric_totals.means())
        self.history.append(result)
        self.iteration += 1
        self.granted -= 1
        if self.on_iteration is not None:
            self.on_iteration(result)

    # -- executing one operation ---------------------------------------------------------

    def execute(self, op: Op, device: torch.device) -> None:
        """Run ``op`` on ``device`` (the shard's state is already there)."""
        with self._carry_lock:
            self._parked = False  # what the op leaves behind is on its device
            self._execute(op, device)

    def _execute(self, op: Op, device: torch.device) -> None:
        shard = self.shards[op.shard]
        t0 = time.perf_counter()
        if shard.pending_step:
            self._step(shard)
        self._on_gpu = self._on_gpu or device.type == "cuda"
        if op.kind is OpKind.FORWARD or op.kind is OpKind.LAST:
            if op.shard == 0 and not self._fetch_train(op.count):
                return
            last = op.kind is OpKind.LAST
            self._inputs[op.shard], self._outputs[op.shard], self._rng_at[op.shard] = [], [], []
            for j in range(len(self._carries)):
                self._forward(shard, device, last, op.batch + j, j)
            if last:
                self._targets = []
        elif op.kind is OpKind.BACKWARD:
            for j in range(op.count):
                self._backward_op(shard, device, op.batch + j, j)
        elif op.kind is OpKind.EVAL:
            self._eval(shard, device)
        self.device_time += time.perf_counter() - t0

    def _fetch_train(self, count: int) -> bool:
        """Fetch up to ``count`` batches into the group; False when none was left."""
        self._carries, self._targets = [], []
        for _ in range(count):
            if not self._fetch_one():
                break
        return bool(self._carries)

    def _fetch_one(self) -> bool:
        if self._train_iter is None:
            self._epoch_rng = rng.RngState(self.rng.cpu.clone())
            if self._skip:  # resuming mid-epoch: replay the epoch's data order, then skip
                with rng.task_stream(
                    self.rng, torch.device("cpu"), self.options.seed, replay=self._resume_epoch_rng
                ):
                    self._train_iter = iter(self.task.train_data)
                    for _ in range(self._skip):
                        next(self._train_iter)
                self._epoch_rng, self._skip = self._resume_epoch_rng, 0
        with rng.task_stream(self.rng, torch.device("cpu"), self.options.seed):
            if self._train_iter is None:
                self._train_iter = iter(self.task.train_data)
            try:
                batch = next(self._train_iter)
            except StopIteration:
                self._exhausted = not self._carries
                return False
        x, y = split_batch(batch, self.name)
        self._carries.append(x)
        self._targets.append(y)
        return True

    def _stream(
        self, shard: ShardRuntime, device: torch.device, replay: rng.RngState | None = None
    ) -> contextlib.AbstractContextManager[rng.RngState | None]:
        """The task's RNG stream around a shard's compute; nothing at all (no lock) for
        shards that were seen not to draw."""
        cpu = shard.cpu_rng is not False
        cuda = device.type == "cuda" and shard.cuda_rng is not False
        if not cpu and not cuda:
            return _NULL
        return self._installed_stream(shard, device, replay, cpu, cuda)

    @contextlib.contextmanager
    def _installed_stream(
        self,
        shard: ShardRuntime,
        device: torch.device,
        replay: rng.RngState | None,
        cpu: bool,
        cuda: bool,
    ) -> Iterator[rng.RngState | None]:
        seed = self.options.seed
        with rng.task_stream(self.rng, device, seed, replay=replay, cpu=cpu, cuda=cuda) as scope:
            yield scope.entry
        if replay is None:
            if cpu and shard.cpu_rng is None:
                shard.cpu_rng = scope.drew_cpu
            if cuda and shard.cuda_rng is None:
                shard.cuda_rng = scope.drew_cuda

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self._autocast_dtype is None:
            return _NULL
        return torch.autocast(device.type, dtype=self._autocast_dtype)

    def _forward(
        self, shard: ShardRuntime, device: torch.device, last: bool, batch: int, j: int
    ) -> None:
        """Micro-batch ``j`` of the group (batch ``batch`` of the epoch) through ``shard``."""
        i = shard.index
        # Held from here on device: the copy another device had is freed at once.
        x = self._carries[j] = to_device(self._carries[j], device)
        k = self.options.accumulate_steps
        keep_graph = last or not self.options.recompute
        inp = detach(x, requires_grad=i > 0 and keep_graph)
        # Issued before the forward's kernels so the copy overlaps them: ``inp`` itself is
        # never written (a shard that writes its input gets a clone).
        saved = None if keep_graph else SavedInput(inp, device)
        arg, before = self._argument(shard, inp)
        with self._stream(shard, device) as entry:
            self._rng_at[i].append(entry)
            same = keep_graph == torch.is_grad_enabled()
            grad_mode = _NULL if same else torch.set_grad_enabled(keep_graph)
            with grad_mode, self._autocast(device):
                out = self._call(shard, arg, batch, train=True)
                if last:
                    target = to_device(self._targets[j], device)
                    loss = self._loss(out, target, batch, train=True)
        self._check_writes(shard, arg, before)
        if last:
            value = float(loss.item())
            if not math.isfinite(value):
                raise NonFiniteLossError(self.name, self.epoch, batch, value)
            self._losses.append(value)
            if batch % k == 0 and shard.optimizer is not None:
                shard.optimizer.zero_grad()
            try:
                # loss / 1 is loss bit for bit; skipping it saves an op and an autograd node
                (loss / k if k > 1 else loss).backward()
            except Exception as err:
                hint = "" if _not_ours(err) else _target_hint(out, target)
                if not hint:
                    raise
                raise DataMismatchError(
                    self.name,
                    f"the backward of the loss raised {_what(err)} on "
                    f"{self._where(batch, True)}: {hint}",
                ) from err
            self._carries[j] = grads_of(inp) if i > 0 else None
            self._after_backward(shard, batch)
            return
        self._inputs[i].append(inp if keep_graph else saved)
        if keep_graph:
            self._outputs[i].append(out)
            out = detach(out, requires_grad=False)
        self._carries[j] = out

    @staticmethod
    def _argument(shard: ShardRuntime, inp: Any) -> tuple[Any, tuple[int, ...] | None]:
        """What the shard's forward gets (a clone if it writes its input, or may: first
        visit), and the version counters to check afterwards (None: nothing to check)."""
        if shard.mutates_input is False:
            return inp, versions(inp)
        arg = clone(inp)
        return arg, (versions(arg) if shard.mutates_input is None else None)

    def _check_writes(self, shard: ShardRuntime, arg: Any, before: tuple[int, ...] | None) -> None:
        if before is None:
            return
        wrote = versions(arg) != before
        if shard.mutates_input is None:
            shard.mutates_input = wrote
        elif wrote:
            raise InvalidModelError(
                f"task {self.name!r}: shard {shard.index} wrote into its input in place, "
                f"which it did not when probed at add_task (or on its first visit); the "
                f"engine keeps that input for the backward. Make the layer's in-place write "
                f"unconditional, or use inplace=False"
            )

    def _backward_op(self, shard: ShardRuntime, device: torch.device, batch: int, j: int) -> None:
        """Micro-batch ``j``'s backward through ``shard``; micro-batches go in order, so
        gradients accumulate in plain training's order."""
        i = shard.index
        grad_out = self._carries[j] = to_device(self._carries[j], device)
        if batch % self.options.accumulate_steps == 0 and shard.optimizer is not None:
            shard.optimizer.zero_grad()
        if self.options.recompute:
            inp = detach(self._inputs[i][j].get(device), requires_grad=i > 0)
            arg = clone(inp) if shard.mutates_input else inp
            # The forward already updated buffers (BatchNorm statistics) once: recompute
            # on throwaway copies, then put the real buffers back.
            slots = shard.store.buffer_slots
            real = [mod._buffers[name] for mod, name in slots]
            for (mod, name), b in zip(slots, real, strict=True):
                mod._buffers[name] = b.clone()  # type: ignore[union-attr]
            try:
                replay = self._rng_at[i][j]
                with (
                    self._stream(shard, device, replay=replay),
                    torch.enable_grad(),
                    self._autocast(device),
                ):
                    out = shard.module(arg)
            finally:
                for (mod, name), b in zip(slots, real, strict=True):
                    mod._buffers[name] = b
        else:
            inp, out = self._inputs[i][j], self._outputs[i][j]
        backward(out, grad_out)
        self._carries[j] = grads_of(inp) if i > 0 else None
        self._after_backward(shard, batch)
        if j == len(self._carries) - 1:  # the group's last: free its saved tensors
            for store in (self._inputs, self._outputs, self._rng_at):
                store.pop(i, None)

    def _after_backward(self, shard: ShardRuntime, batch: int) -> None:
        clip = self.options.max_grad_norm is not None
        if clip:
            grads = [p.grad for p in shard.params if p.grad is not None]
            shard.grad_norms = [torch.linalg.vector_norm(g, 2.0).cpu() for g in grads]
        if (batch + 1) % self.options.accumulate_steps != 0:
            return
        if not clip:
            self._step(shard)
        elif shard.index == 0:  # the last backward of the batch: the global norm is known
            self._schedule_steps()
            self._step(shard)

    def _schedule_steps(self) -> None:
        for s in self.shards:
            s.pending_step = True
        if self.options.max_grad_norm is not None:
            norms = [n for s in self.shards for n in s.grad_norms]
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else None
            self._total_norm = total

    def _step(self, shard: ShardRuntime) -> None:
        grads = [p for p in shard.params if p.grad is not None]
        if self.options.max_grad_norm is not None and self._total_norm is not None and grads:
            total = self._total_norm.to(grads[0].device)
            torch.nn.utils.clip_grads_with_norm_(grads, self.options.max_grad_norm, total)
        if shard.optimizer is not None:
            shard.optimizer.step()
            if shard.scheduler is not None:
                shard.scheduler.step()
        shard.pending_step = False

    def _eval(self, shard: ShardRuntime, device: torch.device) -> None:
        i = shard.index
        if i == 0:
            assert self.task.eval_data is not None
            with rng.task_stream(self.rng, torch.device("cpu"), self.options.seed):
                if self._eval_iter is None:
                    self._eval_iter = iter(self.task.eval_data)
                try:
                    batch = next(self._eval_iter)
                except StopIteration:
                    self._eval_iter = None
                    return
            self._carry, self._target = split_batch(batch, self.name)
        x = self._carry = to_device(self._carry, device)
        shard.module.eval()
        try:
            with self._stream(shard, device), torch.no_grad(), self._autocast(device):
                out = self._call(shard, x, len(self._eval_losses), train=False)
                if i == len(self.shards) - 1:
                    target = to_device(self._target, device)
                    e = len(self._eval_losses)
                    loss = self._loss(out, target, e, train=False)
                    self._eval_losses.append(float(loss.item()))
                    if self._metric_totals.metrics:
                        self._metric_totals.add(out, target, self.name, self._where(e, False))
                    out = None
        finally:
            shard.module.train()
        self._carry = out

    _total_norm: torch.Tensor | None = None

    # -- errors that name the input at fault ----------------------------------------------

    def _where(self, batch: int, train: bool) -> str:
        if train:
            return f"batch {batch} of epoch {self.epoch} of train_data"
        return f"batch {batch} of eval_data (after epoch {self.epoch})"

    def _call(self, shard: ShardRuntime, arg: Any, batch: int, *, train: bool) -> Any:
        """``shard.module(arg)``; a failure on a batch unlike the probed one, or of
        another dtype than the layer, becomes a :class:`DataMismatchError`."""
        try:
            return shard.module(arg)
        except Exception as err:
            mismatch = self._data_mismatch(shard, arg, err, self._where(batch, train))
            if mismatch is None:
                raise
            raise mismatch from err

    def _data_mismatch(
        self, shard: ShardRuntime, arg: Any, err: BaseException, where: str
    ) -> DataMismatchError | None:
        """The error to raise for ``err`` from the first shard's forward on ``arg``, when
        the data can be told to be at fault; ``None`` otherwise (it is raised as is)."""
        if shard.index != 0 or _not_ours(err):
            return None
        names = self.plan.shards[0].layer_names
        layers = {id(m): (n, m) for n, m in zip(names, shard.module, strict=True)}
        found = None
        tb = err.__traceback__
        while tb is not None:  # the innermost frame of one of the shard's layers
            obj = tb.tb_frame.f_locals.get("self")
            hit = layers.get(id(obj))
            if hit is not None and hit[1] is obj:
                found = hit
            tb = tb.tb_next
        if found is None:
            return None
        layer_name, module = found
        first = module is shard.module[0]
        hint = mismatch_hint(arg, module, shapes=first)
        probed = self.probed
        unlike = probed is not None and _signature(arg) != probed[0]
        if not hint and not unlike:
            return None
        note = (
            f"; the batch probed when the task was added: {probed[1]}" if probed and unlike else ""
        )
        return layer_error(self.name, layer_name, module, arg, err, arg, where, note=note)

    def _loss(self, out: Any, target: Any, batch: int, *, train: bool) -> torch.Tensor:
        """``loss_fn(out, target)``, checked to be a scalar tensor (that requires grad,
        in training); a failure with targets that do not fit the output is a
        :class:`DataMismatchError`."""
        try:
            loss = self.task.loss_fn(out, target)
        except Exception as err:
            where = self._where(batch, train)
            hint = "" if _not_ours(err) else _target_hint(out, target)
            if not hint:
                raise
            raise DataMismatchError(
                self.name, f"loss_fn(output, target) raised {_what(err)} on {where}: {hint}"
            ) from err
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            self._bad_loss(loss, self._where(batch, train))
        if train and not loss.requires_grad:
            raise InvalidLossError(
                self.name,
                f"loss_fn returned a tensor that does not require grad on "
                f"{self._where(batch, train)}, so nothing can be back-propagated. Compute it "
                f"from the model's output, without .detach(), torch.no_grad() or a detour "
                f"through numbers",
            )
        return loss

    def _bad_loss(self, loss: Any, where: str) -> NoReturn:
        if not isinstance(loss, torch.Tensor):
            raise InvalidLossError(
                self.name,
                f"loss_fn returned a {type(loss).__name__}, not a tensor, on {where}. Return "
                f"the loss tensor itself (not loss.item() or a number): the engine "
                f"back-propagates it",
            )
        raise InvalidLossError(
            self.name,
            f"loss_fn returned a tensor of shape {list(loss.shape)}, not a scalar, on "
            f"{where}. Reduce it to one number (loss.mean(), or reduction='mean': "
            f"reduction='none' gives one loss per sample)",
        )

    # -- checkpoints (tune_hydra.engine.resume) -------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Everything needed to resume exactly, between iterations (state on the host)."""
        return resume.capture(self)

    def set_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`get_state`'s output into this (fresh) runner."""
        resume.restore(self, state)


_NULL = contextlib.nullcontext()  # reusable: nullcontext keeps no state


def _not_ours(err: BaseException) -> bool:
    """Errors passed on as they are: tune_hydra's own, and running out of memory."""
    return isinstance(err, (TuneHydraError, MemoryError, torch.OutOfMemoryError))


def _what(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _signature(obj: Any) -> Any:
    """A batch's structure, dtypes and shapes but for the batch dimension (the last
    batch of an epoch may be smaller)."""
    flat, spec = tree_flatten(obj)
    return (
        str(spec),
        [(t.dtype, tuple(t.shape[1:])) if isinstance(t, torch.Tensor) else type(t) for t in flat],
    )


def _target_hint(out: Any, target: Any) -> str:
    """What about ``target`` does not fit ``out`` (batch size, floating dtype), or ``""``."""
    if not isinstance(out, torch.Tensor) or not isinstance(target, torch.Tensor):
        return ""
    shown = f"the model's output is {describe(out)}, the target {describe(target)}"
    if out.dim() and target.dim() and out.shape[0] != target.shape[0]:
        return (
            f"{shown}: a batch of {target.shape[0]} targets for {out.shape[0]} inputs. Give "
            f"every batch one target per input"
        )
    if out.is_floating_point() and target.is_floating_point() and out.dtype != target.dtype:
        o = str(out.dtype).removeprefix("torch.")
        return (
            f"{shown}: the targets are another dtype than the model's output. Convert them "
            f"(target.to(torch.{o}) in the data)"
        )
    return ""


def _tied_error(names: tuple[str, ...]) -> Exception:
    from tune_hydra.exceptions import InvalidModelError

    return InvalidModelError(
        f"a parameter is shared between shards (layers {names}: a layer sharing another's "
        f"weights, or a module with parameters that forward calls at two places); tied "
        f"weights across shards are not supported: raise device_memory so the tied layers "
        f"share a shard"
    )
