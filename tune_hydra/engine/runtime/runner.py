"""One task's life in the engine: the order of its shard operations, and their dispatch.

:class:`TaskRunner` produces the task's operations one at a time (a generator resumed
after each operation completes) and runs each on whatever device the scheduler picked,
holding the boundary tensors between them (parked in host memory while the task waits).
The work itself is done by its parts: :mod:`~tune_hydra.engine.runtime.stage` runs a shard's
forward, backward or eval; :mod:`~tune_hydra.engine.runtime.optim` steps the optimizers;
:mod:`~tune_hydra.engine.runtime.data` draws the batches; :mod:`~tune_hydra.engine.runtime.resume`
captures and restores the whole.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.program import Mark, Program
from tune_hydra.engine.dispatch.batched import shared_key
from tune_hydra.engine.registration.partition import ShardPlan, build_optimizer
from tune_hydra.engine.registration.shared import SharedParams
from tune_hydra.engine.runtime import resume, rng
from tune_hydra.engine.runtime.boundary import leaves, park, to_device
from tune_hydra.engine.runtime.checks import BatchChecks
from tune_hydra.engine.runtime.data import DataCursor
from tune_hydra.engine.runtime.metrics import MetricTotals, add_metrics, build_scheduler
from tune_hydra.engine.runtime.optim import Stepper
from tune_hydra.engine.runtime.stage import OpStart, Stage
from tune_hydra.engine.storage import LinkedStore, ShardStore, Store
from tune_hydra.engine.storage.host import HostMemory
from tune_hydra.engine.task import ModelTask, OwnedTensors, owned_tensors
from tune_hydra.exceptions import EmptyDataError
from tune_hydra.options import TrainOptions


@dataclass
class ShardRuntime:
    """A shard's live objects inside the engine."""

    index: int
    module: nn.Sequential
    optimizer: torch.optim.Optimizer | None  # None: the shard has no parameters
    store: Store
    stepper: Stepper  # the task's optimizer stepping (which holds this shard's deferred step)
    # The parameters this shard's optimizer steps (and clips): its own, and those it shares
    # with other shards whose last use in a batch's backward is here.
    params: list[nn.Parameter]
    # With parameters shared with other shards: the gradients this shard sets to None when
    # an accumulation group starts (its own, and the shared ones it back-propagates into
    # first); None: its optimizer's zero_grad().
    zeroes: list[nn.Parameter] | None
    # Shared parameters this shard back-propagates into first / last in a batch, as
    # (their store, index there): their gradients are set aside / added back.
    first_uses: list[tuple[ShardStore, int]]
    last_uses: list[tuple[ShardStore, int]]
    # Whether a visit drew from the CPU / the GPU generator (None: not seen yet). A shard
    # that never drew skips installing that generator, and the CPU lock.
    cpu_rng: bool | None = None
    # Whether its first layer writes into its input in place (ReLU(inplace=True) right
    # after a cut), from the layer probe; None: not known, the first visit computes on a
    # clone and finds out. A shard that writes always computes on a clone.
    mutates_input: bool | None = None
    cuda_rng: bool | None = None
    # The task's lr_scheduler over this shard's optimizer, stepped after each of its steps.
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    @property
    def pending_step(self) -> bool:
        """Whether the shard's optimizer step is deferred to its next visit."""
        return self.stepper.pending(self.index)


class TaskRunner:
    """Produces and executes one task's shard operations: the engine's
    :class:`~tune_hydra.engine.protocol.Runner` for a ``ModelTask``."""

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
        budgeted_graphs: bool = False,
        probed: tuple[Any, str] | None = None,
        host: HostMemory | None = None,
    ) -> None:
        self.name = name
        # The engine's host memory manager, when host memory has a budget (a disk tier).
        self.host = host if host is not None and host.active else None
        self.task = task
        self.plan = plan
        self.options = options
        self.order = order
        self.stepper = Stepper(
            len(plan.shards),
            accumulate_steps=options.accumulate_steps,
            max_grad_norm=options.max_grad_norm,
        )
        self.shards: list[ShardRuntime] = []
        modules = [
            nn.Sequential(*(m for _, m in layers[spec.start : spec.stop])) for spec in plan.shards
        ]
        shared = self._shared = SharedParams(modules)
        optimizers: list[torch.optim.Optimizer | None] = []
        for spec, module in zip(plan.shards, modules, strict=True):
            # A shard of parameter-free layers (ReLU, Dropout alone) has nothing to step;
            # torch optimizers refuse an empty parameter list.
            params = shared.steps(spec.index, module)
            what = f"the parameters of shard {spec.index} (layers {', '.join(spec.layer_names)})"
            opt = build_optimizer(task.optimizer, params, name, what) if params else None
            optimizers.append(opt)
        spill = self._spill_args
        stores = shared.stores(optimizers, pin=pin, task=name, spill=spill)
        for spec, module, opt in zip(plan.shards, modules, optimizers, strict=True):
            what = f"the parameters of shard {spec.index} (layers {', '.join(spec.layer_names)})"
            sched = (
                build_scheduler(task.lr_scheduler, opt, name, f"the optimizer of {what}")
                if opt is not None and task.lr_scheduler is not None
                else None
            )
            own = ShardStore(
                [module],
                opt,
                pin=pin,
                name=(name, spec.index),
                footprint=(spec.state_bytes, spec.activation_bytes),
                params=shared.own(module),
                **spill((name, spec.index)),
            )
            links = [stores[k] for k in shared.groups_of(spec.index)]
            self.shards.append(
                ShardRuntime(
                    spec.index,
                    module,
                    opt,
                    LinkedStore(own, links) if links else own,
                    self.stepper,
                    params=shared.steps(spec.index, module),
                    zeroes=shared.zeroes(spec.index, module) if links else None,
                    first_uses=shared.first_uses(spec.index, stores),
                    last_uses=shared.last_uses(spec.index, stores),
                    mutates_input=spec.writes_input,
                    scheduler=sched,
                )
            )
        self.program = Program(
            name,
            len(self.shards),
            options.accumulate_steps,
            options.iteration_batches,
            task.eval_data is not None,
        )
        # The task's RNG stream: one object, advanced in place by the data and the stage.
        self.rng = rng.seeded_state(options.seed)
        self.data = DataCursor(name, task, options.seed, self.rng)
        self.checks = BatchChecks(name, task, plan.shards[0].layer_names, self.data)
        self.stage = Stage(
            name,
            self.rng,
            self.checks,
            self.stepper,
            seed=options.seed,
            accumulate_steps=options.accumulate_steps,
            recompute=options.recompute,
            precision=options.precision,
        )
        self.iteration = 0
        self.granted = 0
        self.history: list[dict[str, Any]] = []
        self.device_time = 0.0
        # Per micro-batch of the visit's group (one entry unless visits are grouped):
        self._targets: list[Any] = []
        self._carries: list[Any] = []  # activations (forward) or gradients (backward)
        self._carry: Any = None  # the eval batch's activation
        # Held while an op runs; parking the boundary tensors (from another thread) only
        # happens while the task waits, never under a running op.
        self._carry_lock = threading.Lock()
        self._park_lock = threading.Lock()
        self._parked = False  # boundary tensors moved to host memory since the last op
        self._ran = 0  # ops executed: which op's boundary tensors wait now (see carry_parker)
        self._target: Any = None  # the eval batch's target
        self._on_gpu = False
        self._losses: list[float] = []
        self._eval_losses: list[float] = []
        self._metric_totals = MetricTotals(task.metrics)
        self._gen: Generator[Op | None, None, None] = self._life()
        self.current: Op | None = next(self._gen)
        self.on_iteration: Callable[[dict[str, Any]], None] | None = None
        # Whether a batch's kept graphs are reserved on a copying device (the engine's
        # tune_hydra.engine.runtime.kept): one micro-batch's graphs at a time, as on a GPU.
        self.budgeted_graphs = budgeted_graphs
        if probed is not None:  # the probe of the runner this one replaces
            self.checks.probed = probed

    @property
    def probed(self) -> tuple[Any, str] | None:
        """The signature and description of the batch probed at add_task (see
        :meth:`note_probe`): a later batch that fails unlike it is a data mismatch."""
        return self.checks.probed

    def note_probe(self, inputs: Any) -> None:
        """Remember the structure, dtypes and shapes of the inputs the model was probed
        with (not the tensors: a batch can be large)."""
        self.checks.note_probe(inputs)

    # The data cursor's position, read (and, for batch_in_epoch, counted on) by the
    # operation sequence and the engine.
    @property
    def epoch(self) -> int:
        """Epochs finished."""
        return self.data.epoch

    @property
    def batch_in_epoch(self) -> int:
        """Train batches of the current epoch trained on."""
        return self.data.batch_in_epoch

    @batch_in_epoch.setter
    def batch_in_epoch(self, value: int) -> None:
        self.data.batch_in_epoch = value

    @property
    def _exhausted(self) -> bool:
        return self.data.exhausted

    @property
    def _eval_iter(self) -> Iterator[Any] | None:
        return self.data.eval_iter

    @property
    def _outputs(self) -> dict[int, list[Any]]:
        return self.stage.outputs

    def _spill_args(self, name: tuple[str, int]) -> dict[str, Any]:
        """A store's disk-tier keywords: the host memory manager and its spill file."""
        if self.host is None or self.host.folder is None:
            return {}
        return {"host": self.host, "spill_file": self.host.folder.file(name)}

    @property
    def stores(self) -> list[ShardStore]:
        """Every shard store of the task, each once: the shards' own, then shared ones."""
        out: dict[int, ShardStore] = {}
        for s in self.shards:
            store = s.store
            for one in store.parts():
                out[id(one)] = one
        return list(out.values())

    # -- the Runner protocol's views (tune_hydra.engine.protocol) -----------------------

    def store_of(self, shard: int) -> Store:
        """The store holding shard ``shard``'s state."""
        return self.shards[shard].store

    @property
    def ops_per_batch(self) -> int:
        """Ops of one training batch (see :meth:`Program.ops_per_batch`)."""
        return self.program.ops_per_batch

    def ops_until(self, op: Op | None, shard: int) -> int:
        """How many ops from ``op`` until one visits ``shard`` (see
        :meth:`Program.ops_until`)."""
        return self.program.ops_until(op, shard)

    @property
    def batches_done(self) -> int:
        """Train batches of the current iteration run: of the epoch, when an iteration
        is an epoch; 0 with ``iteration_batches`` (its iterations are counted whole)."""
        return self.batch_in_epoch if self.options.iteration_batches is None else 0

    def owned_tensors(self) -> OwnedTensors:
        """The parameters and buffers this task trains, as they are now: the model's live
        tensors and, for shards on a device, their host copies (see
        :func:`~tune_hydra.engine.task.owned_tensors`)."""
        host: list[tuple[Any, torch.Tensor]] = []
        for s in self.shards:
            host.extend(s.store.host_tensors())
        return owned_tensors(self.task.model, host)  # type: ignore[arg-type]

    # -- the operation sequence ---------------------------------------------------------

    def grant(self, iterations: int) -> None:
        """Allow ``iterations`` more iterations (the engine's ``train``)."""
        self.granted += iterations

    def revoke(self) -> None:
        """Take back the iterations not started (the task was cancelled)."""
        self.granted = 0

    def stop(self) -> None:
        """The task failed: it has no next op and no iterations left."""
        self.current = None
        self.granted = 0

    def advance(self) -> Op | None:
        """Move to the next operation (after the current one completed, or a grant)."""
        self.current = next(self._gen)
        return self.current

    def _life(self) -> Generator[Op | None, None, None]:
        """Walk the task's program (:mod:`tune_hydra.core.program`): yield its ops, wait
        (yield ``None``) until an iteration is granted, answer its questions and act at
        its marks."""
        walk = self.program.walk()
        step = next(walk)
        fetched = 0  # micro-batches of the batch in progress
        while True:
            answer = 0
            if isinstance(step, Op):
                yield step
            elif step is Mark.ITERATION:
                while self.granted == 0:
                    yield None
                self._losses = []
                answer = self.iteration
            elif step is Mark.BATCH:
                answer = self.batch_in_epoch
            elif step is Mark.GROUPED:
                answer = self._may_group()
            elif step is Mark.FETCHED:
                fetched = answer = 0 if self._exhausted else len(self._carries)
            elif step is Mark.NO_DATA:
                raise EmptyDataError(
                    f"task {self.name!r}: train_data yielded no batch in epoch "
                    f"{self.epoch}; give it at least one (inputs, targets) pair"
                )
            elif step is Mark.EPOCH_END:
                self._end_epoch()
            elif step is Mark.BATCH_END:
                self.batch_in_epoch += fetched
            elif step is Mark.EVAL:
                self._eval_losses = []
                self._metric_totals = MetricTotals(self.task.metrics)
            elif step is Mark.EVAL_ENDED:
                answer = self._eval_iter is None
            elif step is Mark.PENDING:
                answer = sum(1 << s.index for s in self.shards if s.pending_step)
            elif step is Mark.ITERATION_END:
                self._finish_iteration()
            step = walk.send(answer)

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

    def carry_parker(self) -> Callable[[torch.device, Any], int]:
        """:meth:`park_carries` for the boundary tensors waiting now only (those of the op
        that ran last): once the task's next op has run, it parks nothing and returns 0.

        A worker may call it late (it read the carry, then waited for a lock): by then the
        task may have run its next op on another device and left new boundary tensors
        there, which that device counts; parking those from here would free room the
        device never learns of (on emulated CPU devices every tensor is on ``cpu``).
        """
        ran = self._ran

        def parker(device: torch.device, stream: Any = None) -> int:
            return self.park_carries(device, stream, after=ran)

        return parker

    def park_carries(
        self, device: torch.device, stream: Any = None, after: int | None = None
    ) -> int:
        """Move the boundary tensors waiting on ``device`` to host memory (pinned, from a
        GPU), so that other tasks' ops can use the room; the next op copies them back.

        Called from a worker thread while the task waits. Returns the bytes moved: 0 when
        the task's op is running (its inputs are in use), nothing waits on ``device``, or
        (with ``after``) the task's ops run since are not ``after`` (the tensors asked for
        were consumed; see :meth:`carry_parker`).
        On a CPU device (``copy_on_cpu``) the copy is a clone, which is the same logic.
        """
        # Another thread parking them: wait until they are off the device (its caller
        # counts them as freed; this one must not go on while they still occupy it).
        with self._park_lock:
            if not self._carry_lock.acquire(blocking=False):
                return 0
            try:
                if self._parked or (after is not None and after != self._ran):
                    return 0
                parked, moved = park([*self._carries, self._carry], device, stream)
                self._carries, self._carry = parked[:-1], parked[-1]
                self._parked = moved > 0
                if moved and self.host is not None:
                    self.host.park(self.name, moved)
                return moved
            finally:
                self._carry_lock.release()

    def drop_batch(self) -> None:
        """Let go of the batch in progress (its kept graphs, saved inputs and boundary
        tensors): the task failed or was cancelled, and will not go on with it."""
        with self._carry_lock:
            self.stage.drop_batch()
            self._carries, self._carry, self._targets = [], None, []
            if self.host is not None:
                self.host.unpark(self.name)

    def next_shard(self, op: Op) -> int | None:
        """The shard the task's op after ``op`` will most likely use (for prefetching it
        while ``op`` runs); ``None`` when that is ``op``'s own shard or unknown."""
        return self.program.next_shard(op)

    def _may_group(self) -> bool:
        """Whether the next visits may run the rest of the accumulation group (see
        :meth:`Program.group_count`): when that keeps plain training's order of random
        draws (no shard draws any)."""
        rng_free = all(
            s.cpu_rng is False and (s.cuda_rng is False or not self._on_gpu) for s in self.shards
        )
        # Kept graphs of a whole group would sit in device memory the plan did not budget.
        kept = not self.options.recompute and (self._on_gpu or self.budgeted_graphs)
        # A shared parameter's gradient is summed per micro-batch (registration/shared.py):
        # its uses must not interleave with another micro-batch's.
        return rng_free and not kept and not self._shared

    def _end_epoch(self) -> None:
        self.stepper.end_epoch(self.data.batch_in_epoch)
        self.data.end_epoch()

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
            add_metrics(result, self._metric_totals.means())  # a "loss" of its own wins
        self.history.append(result)
        self.iteration += 1
        self.granted -= 1
        if self.on_iteration is not None:
            self.on_iteration(result)

    # -- executing one operation ---------------------------------------------------------

    @property
    def op_lock(self) -> threading.Lock:
        """Held while an op of the task runs (:meth:`execute`, or a batched pass with
        other tasks' ops: several held at once are taken in the order of the names)."""
        return self._carry_lock

    def execute(self, op: Op, device: torch.device) -> None:
        """Run ``op`` on ``device`` (the shard's state is already there)."""
        with self._carry_lock:
            t0 = time.perf_counter()
            if self.open_op(op, device):
                self.run_op(op, device)
                self.close_op(time.perf_counter() - t0)

    # The steps of execute, which a batched pass (tune_hydra.engine.dispatch.batched) takes too,
    # with its own compute in between: under op_lock, open_op; then run_op, or op_start,
    # the pass and take_forward / take_backward; then close_op.

    def open_op(self, op: Op, device: torch.device) -> bool:
        """Start ``op`` on ``device``: its boundary tensors taken back from the host
        memory's count (the op moves them to its device), the shard's deferred optimizer
        step, and for a training visit of shard 0 the next micro-batches. Returns False
        when there is nothing to compute (the epoch's data ended)."""
        if self._parked and self.host is not None:
            self.host.unpark(self.name)
        self._parked = False  # what the op leaves behind is on its device
        self._ran += 1
        self.stepper.step_pending(self.shards[op.shard])
        self._on_gpu = self._on_gpu or device.type == "cuda"
        if (op.kind is OpKind.FORWARD or op.kind is OpKind.LAST) and op.shard == 0:
            self._carries, self._targets = self.data.fetch_train(op.count)
            return bool(self._carries)
        return True

    def run_op(self, op: Op, device: torch.device) -> None:
        """Compute ``op`` (opened with :meth:`open_op`) on ``device``."""
        shard = self.shards[op.shard]
        if op.kind is OpKind.LAST:
            losses = self.stage.forward_loss(shard, device, self._carries, self._targets, op.batch)
            self._losses.extend(losses)
            self._targets = []
        elif op.kind is OpKind.FORWARD:
            self.stage.forward(shard, device, self._carries, op.batch)
        elif op.kind is OpKind.BACKWARD:
            self.stage.backward(shard, device, self._carries, op.batch, op.count)
        elif op.kind is OpKind.EVAL:
            self._eval(shard, device)

    def close_op(self, seconds: float) -> None:
        """``op`` ended: it computed for ``seconds`` (this task's share of a batched
        pass)."""
        self.device_time += seconds

    def batch_key(self, op: Op) -> frozenset[int] | None:
        """What ``op`` may be batched on with other tasks' ops (see
        :func:`~tune_hydra.engine.dispatch.batched.shared_key`), or ``None``: it runs alone. Only
        recomputing ops without autocast; a forward of a shard that does not write its
        input; the last shard's ops (the loss) only grouped, never batched."""
        if not self.options.recompute or self.stage.autocasts:
            return None
        if (op.kind is OpKind.LAST) != (op.shard == len(self.shards) - 1):
            return None
        if op.kind is not OpKind.LAST and self.shards[op.shard].mutates_input is not False:
            return None
        return shared_key(self.store_of(op.shard))

    def op_start(self, op: Op, device: torch.device) -> OpStart:
        """What ``op`` (opened; a forward that is not the last shard's, or a recomputing
        backward; one micro-batch) starts from, to compute it outside the stage. Changes
        nothing: a pass that fails leaves the task as it was."""
        shard = self.shards[op.shard]
        if op.kind is OpKind.FORWARD:
            return self.stage.forward_start(device, self._carries[0])
        return self.stage.backward_start(shard, device, self._carries[0])

    def scratch_buffers(self, op: Op) -> contextlib.AbstractContextManager[None]:
        """Around a recompute of ``op``'s shard: its buffers as throwaway copies."""
        return self.stage.scratch_buffers(self.shards[op.shard])

    def take_forward(self, op: Op, start: OpStart, out: Any, cpu_after: torch.Tensor) -> None:
        """``op``'s forward, computed from ``start``, gave ``out`` and left the CPU
        generator at ``cpu_after``: the task goes on as if it had run it."""
        self._carries[0] = self.stage.forward_taken(self.shards[op.shard], start, out, cpu_after)

    def take_backward(self, op: Op, start: OpStart, grads: Sequence[torch.Tensor | None]) -> None:
        """``op``'s backward, computed from ``start``, gave ``grads`` (of ``start.wrt``):
        they accumulate, the optimizer steps when due, the input's gradient is the carry."""
        shard = self.shards[op.shard]
        self._carries[0] = self.stage.backward_taken(shard, start, grads, op.batch)

    def _eval(self, shard: ShardRuntime, device: torch.device) -> None:
        if shard.index == 0:
            batch = self.data.next_eval()
            if batch is None:
                return
            self._carry, self._target = batch
        self._carry = to_device(self._carry, device)
        e = len(self._eval_losses)
        if shard.index == len(self.shards) - 1:
            metrics = self._metric_totals
            loss = self.stage.eval_loss(shard, device, self._carry, self._target, e, metrics)
            self._eval_losses.append(loss)
            self._carry = None
        else:
            self._carry = self.stage.eval(shard, device, self._carry, e)

    # -- checkpoints (tune_hydra.engine.runtime.resume) -------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Everything needed to resume exactly, between iterations (state on the host)."""
        return resume.capture(self)

    def set_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`get_state`'s output into this (fresh) runner."""
        resume.restore(self, state)

    def resume_at(self, iteration: int, stream: rng.RngState) -> None:
        """Go on from ``iteration`` with the task's RNG stream at ``stream`` (a restored
        state; its tensors are taken, not copied)."""
        self.iteration = iteration
        # In place: the data cursor and the stage advance this same object.
        self.rng.cpu, self.rng.cuda = stream.cpu, stream.cuda
