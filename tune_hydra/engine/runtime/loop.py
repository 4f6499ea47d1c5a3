"""A training loop the user drives, as shard ops the engine schedules: :class:`LoopRunner`.

``th.shard(model, optimizer)`` (:mod:`tune_hydra.frontends.shard`) keeps the user's loop
as it is. Each call of the model becomes one op per shard, announced from the user's
thread: :meth:`LoopRunner.run` makes it the runner's :attr:`~LoopRunner.current` op and
grants it (``Engine.train(name, 1)``: one op is one of the runner's iterations), the
engine's dispatcher picks a device when it is the op's turn among every task sharing
the engine, the device's worker makes the shard resident (a lease, the one path) and
runs :meth:`LoopRunner.execute`, and the user's thread, which waited, goes on with the
result. Ops of one loop run one at a time, in the user's order.

- **forward** (:meth:`LoopRunner.forward`): with grad enabled, each shard is a
  ``torch.autograd.Function`` (:class:`_ShardFunction`) whose forward runs the shard under
  ``no_grad`` and keeps only its input (and the RNG state it started from), and whose
  backward is a *backward op*: the shard's forward recomputed with grad on the same random
  numbers, back-propagated from the incoming gradient, accumulating into the shard's
  parameters' ``.grad`` (several ``backward()`` per step add up, as plain PyTorch), and
  the input's gradient handed back. The graph the user's thread sees lives on the device
  of the inputs, so ``loss.backward()`` runs these backward ops from the user's thread.
  Without grad (``torch.no_grad()``, evaluation) the ops keep nothing.
- **other backward passes** (:class:`_Reach`): ``backward(retain_graph=True)`` then
  another ``backward()`` recomputes again (the gradients add up); a second one without
  ``retain_graph`` raises torch's own error (the saved input was freed).
  ``torch.autograd.grad`` (or ``backward(inputs=...)``) w.r.t. the model's inputs runs
  backward ops that hand back the inputs' gradients alone, the parameters' ``.grad``
  untouched; w.r.t. the parameters (whose gradients the engine accumulates on its
  devices), and double backward (``create_graph=True``), raise
  :class:`~tune_hydra.exceptions.UnsupportedCallError`.
- **kept graphs**: on an engine that keeps graphs (``recompute=False``) a forward op runs
  the shard with grad instead and keeps its graph (activations) on the device until the
  shard's backward op back-propagates through it; the engine reserves the batch's
  activations on the device where its first forward ran and keeps the batch's ops there
  (``tune_hydra.engine.runtime.kept``; :attr:`LoopRunner.keeps_batch` tells it the batch is still
  open while the user's code runs between ops). A loop whose batch would not fit the
  budget with every shard's activations kept recomputes instead. The shard's input is
  saved at home as well: a retained graph's second backward recomputes from it (the kept
  graph is let go after the first, to free the device).
- **optimizer**: the user's optimizer is split per shard (same class, same hyperparameter
  groups); ``step()`` and ``zero_grad()`` are recorded per shard and applied at the start
  of the shard's next op (the state is on a device then anyway), each step with the
  hyperparameters its groups had when ``step()`` was called (so an lr scheduler stepping
  right after works); :meth:`LoopRunner.sync` applies what is pending (as step ops) and
  brings every state home, for the user's thread to read or write the model's tensors. A
  step that raises does so at that op (the next forward, or a sync: ``state_dict()``,
  ``th.unshard``), once. Groups added after the cut (``add_param_group``: gradual
  unfreezing) are split the same way (:meth:`LoopRunner.follow_groups`), and
  :meth:`LoopRunner.close` hands every shard's state back to the user's optimizer.
- **random numbers**: an op draws from a generator of its own loop on the device's
  thread (the thread-local dispatch mode of :func:`use_generator` (registration/factory.py)
  adds it to every CPU random op), never from torch's global generator, so no other
  thread's draws can land inside an op or consume its stream. Which stream that is
  follows the user's thread, as in plain PyTorch: a thread on a private generator
  (:func:`~tune_hydra.engine.registration.factory.private_rng`: ``th.optimize``'s objectives, the
  Ray front end's function trainables) lends it to its loop's ops, so its own draws (a
  shuffling ``DataLoader``) and the ops' dropout come from one stream, in order; on the
  main thread the global generator's state is handed to the op and back (the same one
  stream); on another thread (``study.optimize(n_jobs>1)``) the loop keeps a stream of
  its own, started from the global generator's state at ``th.shard`` (the global one is
  shared by threads: drawing from it would make each loop's dropout depend on the
  others'). The user's own draws in their thread stay exactly plain PyTorch's.

:class:`LoopRunner` exchanges the ops with the engine; its parts are collaborators of
their own: the forward as ops (:class:`LoopGraph`), the optimizer's part
(:mod:`~tune_hydra.engine.runtime.loop_optim`), the random streams
(:mod:`~tune_hydra.engine.runtime.loop_random`), the plan sized for the largest batch
(:mod:`~tune_hydra.engine.runtime.loop_sizing`), the ops' order
(:mod:`~tune_hydra.engine.runtime.loop_pattern`) and the states at home
(:mod:`~tune_hydra.engine.runtime.loop_home`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.engine.dispatch.batched import is_lora_layer, shared_key
from tune_hydra.engine.protocol import stores_of
from tune_hydra.engine.registration.factory import use_generator
from tune_hydra.engine.registration.partition import (
    LayerCost,
    ShardPlan,
    layer_costs,
    plan_shards,
    tensor_bytes,
)
from tune_hydra.engine.registration.shared import SharedParams
from tune_hydra.engine.runtime import amp, loop_home, rng
from tune_hydra.engine.runtime.boundary import OpStart, accumulate_grad
from tune_hydra.engine.runtime.boundary import backward as backward_from
from tune_hydra.engine.runtime.compiled import Compiler, ShardCompiler, recompile
from tune_hydra.engine.runtime.loop_optim import LoopOptimizer, optimizer_like
from tune_hydra.engine.runtime.loop_pattern import OpPattern
from tune_hydra.engine.runtime.loop_random import Entry, LoopRandom
from tune_hydra.engine.runtime.loop_sizing import LoopSizing
from tune_hydra.engine.storage import LinkedStore, ShardStore, Store
from tune_hydra.engine.task import OwnedTensors, owned_tensors
from tune_hydra.engine.units import device_budget
from tune_hydra.exceptions import (
    ShardClosedError,
    SharedModelError,
    SharedShardModelError,
    TaskFailedError,
    UnsupportedCallError,
    format_bytes,
)
from tune_hydra.models.hf import HeadStage
from tune_hydra.options import TrainOptions

if TYPE_CHECKING:
    from tune_hydra.engine.engine import Engine

log = logging.getLogger(__name__)
_TRAIN = (OpKind.FORWARD, OpKind.LAST, OpKind.BACKWARD)  # ops of a training batch
_GRADS = (OpKind.LAST, OpKind.BACKWARD)  # ops that leave gradients
_LOCAL = threading.local()  # .depth > 0: this thread computes inside an op (or a probe)
_NAMES = itertools.count()


class ChainOp(Protocol):
    """One op of :meth:`LoopRunner.run_chain`, bound to the op before's result when that
    one ends: ``bind(value)`` returns the op's compute, ``fn(device)`` (an op object a
    batched pass may compute, such as :class:`ForwardOp`, or any callable)."""

    def bind(self, value: Any) -> Callable[[torch.device], Any]: ...


# One op of LoopRunner.run_chain: its kind, shard, the op and its autocast state.
ChainStep = tuple[OpKind, int, ChainOp, "amp.Autocast | None"]


def in_op() -> bool:
    """Whether the calling thread is computing one of a loop's ops (or probing its
    layers): a sharded model called there runs its own ``forward`` (a Hugging Face stage
    runs parts of the model's ``forward``)."""
    return getattr(_LOCAL, "depth", 0) > 0


@contextlib.contextmanager
def inside_op() -> Iterator[None]:
    """Mark the calling thread as computing inside an op (see :func:`in_op`)."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


@dataclass
class LoopShard:
    """One shard of a loop: its modules, optimizer, store, and what waits for its next op.

    Attributes:
        pending: ``("step", hyperparameters per local group)`` and ``("zero",
            (set_to_none, parameters))`` recorded by the user's ``step()`` /
            ``zero_grad()``, applied in order at the start of the shard's next op.
    """

    index: int
    module: nn.Sequential
    optimizer: torch.optim.Optimizer | None
    store: Store
    # The user's param-group index of each of its optimizer's groups.
    group_map: list[int]
    zeroes: list[nn.Parameter]
    first_uses: list[tuple[ShardStore, int]]
    last_uses: list[tuple[ShardStore, int]]
    writes_input: bool | None
    pending: list[tuple[str, Any]] = field(default_factory=list)
    # (training, drew from the CPU generator) once seen; a shard that does not draw skips
    # installing the stream (and its lock).
    draws: dict[bool, bool] = field(default_factory=dict)
    # Optimizer steps applied so far: a recompute checks that its forward's weights are
    # still the shard's (a step between a forward and its backward).
    steps: int = 0
    headless: bool | None = None  # holds no model head (batch_key), once looked up
    # Ops opened so far, and the gradient norms its last backward op took (once the loop
    # clips: LoopOptimizer.take_norms), valid while no op came after it.
    ops: int = 0
    norms: dict[int, torch.Tensor] | None = None
    norms_at: int = -1

    def group_key(self) -> frozenset[int] | None:
        """What the shard's recomputing ops may be grouped on with other tasks' ops, in
        one assignment on one device (the shared frozen tensors of its store, see
        :func:`~tune_hydra.engine.dispatch.batched.shared_key`; one pass where
        :meth:`batchable`, else one after another), or ``None``: they run alone. Not a
        shard that shares a parameter with another shard of its model."""
        if self.first_uses or self.last_uses:
            return None
        # A forward hook on an adapted layer is this loop's own code, which a pass would
        # call for every trial's rows or not at all (the pass refuses it, and its members
        # then run one after another before the frozen checks: a hook writing the base
        # would be read by the next): its ops run alone, checked at once. Looked up each
        # time: a hook may come at any step.
        for m in self.module.modules():
            if is_lora_layer(m) and any(
                isinstance(h, torch.nn.Module) and (h._forward_hooks or h._forward_pre_hooks)
                for h in (m, m.base_layer)
            ):
                return None
        return shared_key(self.store)

    def batchable(self) -> bool:
        """Whether a group of its ops may be one batched pass: a shard that does not
        write its input and holds no model head (the head's ops of a group run one after
        another: the group stays together for the shards after it)."""
        if self.writes_input is not False:
            return False
        if self.headless is None:
            self.headless = not any(isinstance(m, HeadStage) for m in self.module.modules())
        return self.headless


class LoopRunner:
    """The :class:`~tune_hydra.engine.protocol.Runner` of one user-driven loop.

    Build it with :func:`build_loop` (which cuts the model on its first batch); the
    user's thread calls :meth:`forward`, :meth:`step`, :meth:`zero_grad` and :meth:`sync`.
    """

    comes_back = True  # its thread issues its next op soon: a device waits (anticipate.py)
    _compiler: ShardCompiler | None = None  # compile(): the shards' torch.compile

    def __init__(
        self,
        name: str,
        engine: Engine,
        model: nn.Module,
        plan: ShardPlan,
        shards: list[LoopShard],
        user_optimizer: torch.optim.Optimizer | None,
        wrappers: list[nn.Module],
        *,
        rng_start: torch.Tensor,
        hf: bool,
        keep: bool = False,
        optimizer_class: type[torch.optim.Optimizer] | None = None,
        probe_bytes: int = 0,
    ) -> None:
        self.name = name
        self.engine = engine
        # Weakly: the model's garbage collection removes the loop (th.shard's finalizer).
        self._model = weakref.ref(model)
        self.shards = shards
        # The plan, sized for the largest training batch so far (the probe's at first).
        self.sizing = LoopSizing(
            name, engine, self._model, shards, plan, keep=keep, probe_bytes=probe_bytes
        )
        # The user's optimizer (and its class, build_loop's), split per shard.
        self.optim = LoopOptimizer(shards, user_optimizer, optimizer_class)
        self._wrappers = wrappers  # modules of the cut that are not the user's
        self._hf = hf
        # Where boundary tensors wait between ops and the user's autograd graph of the
        # shards lives: host memory, so that loss.backward() runs the shards' nodes on the
        # user's thread (a CUDA node would block autograd's one thread per device).
        self.home = torch.device("cpu")
        self.current: Op | None = None
        self.iteration = 0  # its iterations (op chains) finished
        self.device_time = 0.0  # seconds its ops computed (a batched pass: its share)
        # The op asked for, its compute, and the autocast state of the thread that asked.
        self._request: tuple[Op, Callable[[torch.device], Any], amp.Autocast | None] | None = None
        self._chain: list[ChainStep] = []  # the ops of run_chain still to come
        self._running = False
        self._result: tuple[bool, Any] = (True, None)
        self._op_lock = threading.Lock()
        # Its ops' iteration: the results its front end has seen (th.optimize counts the
        # trial.report calls), which the milestone policy reads as the loop's progress.
        self.reports = 0
        self.pattern = OpPattern(len(shards))  # its ops' order, learnt as they run
        self._home = loop_home.HomeWindow(shards, engine.host)  # the user's at home
        self.closed = False
        self.keep = keep  # forward ops keep their graphs for the backward (no recompute)
        self.graph = LoopGraph(keep)  # the forward as ops, the user's graph of them
        # The ops' random streams (see the module docstring).
        self.random = LoopRandom(rng_start)
        # On an engine with one CPU device (th.shard's embedded one on a CPU machine) each
        # op computes with the intra-op thread count the user's thread has at that op (read
        # by run): a reduction split across threads (a conv's weight gradient) then rounds
        # as plain PyTorch's at the user's setting, whenever either was set. Several
        # emulated CPU devices keep their split of the threads (see the README).
        self._follow_threads = sum(d.type == "cpu" for d in engine.devices) == 1
        self._threads = torch.get_num_threads()

    @property
    def model(self) -> nn.Module:
        """The user's model.

        Raises:
            ShardClosedError: it was garbage-collected.
        """
        model = self._model()
        if model is None:
            raise ShardClosedError(f"loop {self.name!r}: its model was garbage-collected")
        return model

    @property
    def frozen_model(self) -> nn.Module | None:
        """The model whose frozen tensors the engine shares with other tasks' equal ones
        (``TaskRegistry.add_runner``; ``None`` once garbage-collected)."""
        return self._model()

    # -- the Runner protocol ------------------------------------------------------------

    @property
    def plan(self) -> ShardPlan:
        return self.sizing.plan

    @property
    def order(self) -> OpPattern:
        return self.pattern

    @property
    def stores(self) -> list[ShardStore]:
        """Its shard stores, each once."""
        return stores_of(self)

    def stop(self) -> None:
        self.current = None
        self._running = False
        self._chain = []
        self.graph.drop()  # its kept graphs: no backward will come for them

    def advance(self) -> Op | None:
        if self._running and self._chain and self._result[0]:  # the chain's next op, now
            kind, shard, fn, autocast = self._chain.pop(0)
            try:
                compute = fn.bind(self._result[1])
            except BaseException as err:  # the chain ends with this error
                self._result, self._chain = (False, err), []
                return self.advance()
            op = self.pattern.next_op(self.name, kind, shard, self.reports)
            self._request = (op, compute, autocast)
            self.current = op
            return op
        if self._running:  # the current op (chain) completed: its one iteration ends
            if not self._result[0] and self.current is not None and self.current.kind in _TRAIN:
                self.graph.drop()  # a failed batch's graphs: no backward will come for them
            self._running = False
            self.current = None
            self.iteration += 1
            return None  # the engine then resolves the user's wait: nothing after
        if self._request is None:  # (the engine advances it only with a grant)
            self.current = None
            return None
        self.current = self._request[0]
        self._running = True
        return self.current

    def execute(self, op: Op, device: torch.device) -> None:
        t0 = time.perf_counter()
        if self.open_op(op, device):
            self.run_op(op, device)
        self.close_op(time.perf_counter() - t0)

    # The steps of execute, which a batched pass (tune_hydra.engine.dispatch.batched) takes too,
    # with its own compute in between: under op_lock, open_op; then run_op, or op_start,
    # the pass and take_forward / take_backward; then close_op. The user's errors (a
    # pending step's, the model's) are the op's result, raised in the user's thread.

    @property
    def op_lock(self) -> threading.Lock:
        """Held while an op of the loop runs in a batched pass."""
        return self._op_lock

    def op_scope(self) -> contextlib.AbstractContextManager[None]:
        """What a batched pass computes the loop's op inside (:func:`inside_op`: a
        Hugging Face stage runs the model's own ``forward``)."""
        return inside_op()

    def open_op(self, op: Op, device: torch.device) -> bool:
        """Start ``op`` on ``device``: the thread count, the shard's pending optimizer
        steps, the cut's modules in the user's mode. False: that failed (the error is the
        op's result), nothing to compute."""
        assert self._request is not None and self._request[0] is op
        if (
            self._follow_threads
            and device.type == "cpu"
            and torch.get_num_threads() != self._threads
        ):
            torch.set_num_threads(self._threads)  # this (the device's) thread's count
        self.shards[op.shard].ops += 1
        try:
            with inside_op():
                self.optim.apply_pending(self.shards[op.shard])
                training = self.model.training
                for m in self._wrappers:  # the cut's own modules follow the user's mode
                    if m.training is not training:  # (Module.__setattr__ is slow)
                        m.training = training
                amp.check_device(self._request[2], device)
        except BaseException as err:  # the user's code failed: raised in the user's thread
            self._result = (False, err)
            return False
        return True

    def run_op(self, op: Op, device: torch.device) -> None:
        """Compute ``op`` (opened) on ``device``: its result, or the user's error."""
        assert self._request is not None
        _, fn, autocast = self._request
        try:
            with inside_op(), amp.entered(autocast):  # the asking thread's state
                self._result = (True, fn(device))
            if op.kind in _GRADS:
                self.optim.take_norms(self.shards[op.shard])
        except BaseException as err:  # the user's code failed: raised in the user's thread
            self._result = (False, err)

    def close_op(self, seconds: float) -> None:
        """The op ended: it computed for ``seconds`` (its share of a batched pass)."""
        self.device_time += seconds

    def batch_key(self, op: Op) -> frozenset[int] | None:
        """What ``op`` may be grouped on with other tasks' ops in one assignment (the
        shared frozen tensors of its shard, :meth:`LoopShard.group_key`), or ``None``: it
        runs alone. Not an op under autocast or compile."""
        req = self._request
        if req is None or req[0] is not op or req[2] is not None or self._compiler:
            return None
        return self.shards[op.shard].group_key()

    def batchable(self, op: Op) -> bool:
        """Whether ``op`` (grouped: :meth:`batch_key`) may be computed in a batched pass:
        a recomputing forward or backward without autocast, of a
        :meth:`LoopShard.batchable` shard; else the group runs it on its own."""
        req = self._request
        if req is None or req[0] is not op:
            return False
        fn = req[1]
        if not isinstance(fn, (ForwardOp, BackwardOp)) or fn.call.autocast is not None:
            return False
        if isinstance(fn, BackwardOp) and fn.inputs_only:
            return False
        return self.shards[op.shard].batchable()

    def op_start(self, op: Op, device: torch.device) -> OpStart:
        """What ``op`` (opened, :meth:`batchable`) starts from, to compute it in
        a batched pass. Changes nothing."""
        assert self._request is not None
        fn = self._request[1]
        assert isinstance(fn, (ForwardOp, BackwardOp))
        return fn.start(device)

    def take_forward(self, op: Op, start: OpStart, out: Any, cpu_after: torch.Tensor) -> None:
        """``op``'s forward, computed in a batched pass from ``start``, gave ``out`` and
        left the CPU generator at ``cpu_after``: the loop goes on as if it had run it."""
        assert self._request is not None
        fn = self._request[1]
        assert isinstance(fn, ForwardOp)
        self._result = (True, fn.take(start, out, cpu_after))

    def take_backward(self, op: Op, start: OpStart, grads: Sequence[torch.Tensor | None]) -> None:
        """``op``'s backward, computed in a batched pass from ``start``, gave ``grads``
        (of ``start.wrt``): they accumulate as autograd's would, the inputs' are the
        result."""
        assert self._request is not None
        fn = self._request[1]
        assert isinstance(fn, BackwardOp)
        self._result = (True, fn.take(start, grads))
        self.optim.take_norms(self.shards[op.shard])

    def scratch_buffers(self, op: Op) -> contextlib.AbstractContextManager[None]:
        """Around a recompute of ``op``'s shard: its buffers as throwaway copies."""
        return _scratch_buffers(self.shards[op.shard])

    def store_of(self, shard: int) -> Store:
        return self.shards[shard].store

    @property
    def keeps_batch(self) -> bool:
        """Whether a forward's graph is kept for a backward still to come: the batch is
        in progress though no op is ready (the user's code runs between its ops), so the
        engine holds its reservation and keeps its ops on its device."""
        return self.graph.keeps()

    def owned_tensors(self) -> OwnedTensors:
        return _owned(self._model(), self.shards)

    # -- ops, from the user's thread ----------------------------------------------------

    def run(self, kind: OpKind, shard: int, fn: Callable[[torch.device], Any]) -> Any:
        """Run ``fn(device)`` as op ``kind`` of ``shard`` on the device the engine picks;
        its result, or its error raised here (see :meth:`run_chain`)."""
        return self.run_chain([(kind, shard, _Given(fn), amp.current())])

    def run_chain(self, steps: list[ChainStep], first: Any = None) -> Any:
        """Run ops one after another as one of the loop's iterations: step ``i`` is op
        ``kind`` of ``shard`` computing ``op.bind(result of step i - 1)`` (step 0 binds
        ``first``) under ``autocast``. The engine starts each op as the one before ends
        (:meth:`advance`, on its own thread), as a ``ModelTask``'s program runs, not after
        a round trip through this thread. Returns the last op's result; the first error
        ends the chain and is raised here.

        Raises:
            ShardClosedError: the loop was closed.
            TaskFailedError: the engine failed the loop (an engine error, not the user's).
        """
        if self.closed:
            raise ShardClosedError(
                f"{type(self.model).__name__} was unsharded (its loop {self.name!r} is "
                f"closed); call th.shard on a fresh model to train it on the engine again"
            )
        kind, shard, first_op, autocast = steps[0]
        op = self.pattern.next_op(self.name, kind, shard, self.reports)  # reports: __init__
        self._home.leave()
        self._request = (op, first_op.bind(first), autocast)
        self._chain = list(steps[1:])
        # On the main thread (no private generator) the global generator's stream is the
        # loop's (plain PyTorch's one stream): into the ops and back, for ops that may draw.
        hand_off = self.random.choose() and any(_may_draw(self, k, s) for k, s, _, _ in steps)
        gen = self.random.op_gen
        if self._follow_threads:
            self._threads = torch.get_num_threads()  # execute computes with it
        if hand_off:
            gen.set_state(torch.get_rng_state())
        try:
            # Dispatched on this thread as the grant is made (not by waking the engine's
            # dispatch thread: a thread hand-off less per op).
            with self.engine.hold_dispatch():
                done = self.engine.train(self.name, 1)
            done.result()
        finally:
            self._request = None
            self._chain = []
            # Taken here even when the engine failed the op: an error of the op's own kept
            # on the runner would keep its frames (and a Hugging Face stage's model).
            ok, value = self._result
            self._result = (True, None)
        if hand_off:
            torch.set_rng_state(gen.get_state())
        if not ok:
            raise value
        return value

    def forward(self, inputs: Any) -> Any:
        """The model's forward on ``inputs``, shard by shard (see the module docstring).

        Raises:
            BatchTooLargeError: a training batch larger than the one the cut was sized on
                that the cut cannot hold within the budget (see :meth:`LoopSizing.fit`).
        """
        return self.graph.forward(self, inputs)

    # -- the optimizer's part (tune_hydra.engine.runtime.loop_optim) ----------------------

    @property
    def user_optimizer(self) -> torch.optim.Optimizer | None:
        """The user's optimizer (``None``: the loop steps nothing)."""
        return self.optim.user_optimizer

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer] | None:
        """The user's optimizer's class (its shards' optimizers are of it)."""
        return self.optim.optimizer_class

    def step(self) -> None:
        """Record an optimizer step for every shard, with the hyperparameters the user's
        param groups have now."""
        self.optim.step(self.sync)
        self._home.leave()

    def clip_grad_norm(
        self,
        max_norm: float | None,
        *,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
        params: Sequence[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (``params`` ``None``: the
        model's ``parameters()``), the gradients left on their devices (see
        :meth:`LoopOptimizer.clip_grad_norm`; ``finish`` and ``max_norm=None`` there)."""
        if not self.at_home:
            total = self.optim.clip_grad_norm(self.model, max_norm, self.run, finish, params)
            if total is not None:
                return total
        given = self._home_params(params)  # home already (a GradScaler's), or one outside
        total = torch.nn.utils.get_total_norm([p.grad for p in given if p.grad is not None])
        total = total if finish is None else finish(total)
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(given, max_norm, total)
        return total

    def clip_grad_value(
        self, clip_value: float, *, params: Sequence[nn.Parameter] | None = None
    ) -> None:
        """``torch.nn.utils.clip_grad_value_(params, clip_value)`` (``params`` ``None``:
        the model's ``parameters()``): each shard's gradients clamped before its step
        (see :meth:`LoopOptimizer.clip_grad_value`), or at home."""
        if self.at_home or not self.optim.clip_grad_value(self.model, clip_value, params):
            torch.nn.utils.clip_grad.clip_grad_value_(self._home_params(params), clip_value)

    def _home_params(self, params: Sequence[nn.Parameter] | None) -> list[nn.Parameter]:
        """The state brought home for the caller to change; ``params`` (``None``: the
        model's)."""
        self.sync()
        self.touched()
        return list(nn.Module.parameters(self.model) if params is None else params)

    @property
    def at_home(self) -> bool:
        """Whether every shard's state is home now, nothing pending (since a sync)."""
        return self._home.now

    def zero_grad(self, set_to_none: bool = True, *, optimizer: bool = False) -> None:
        """Record ``zero_grad`` for every shard: of every parameter (the model's), or with
        ``optimizer`` of the user's optimizer's parameters only (as its ``zero_grad()``)."""
        self.optim.zero_grad(set_to_none, optimizer, self.sync)
        self._home.leave()

    def follow_groups(self) -> None:
        """Give the shards' optimizers the param groups the user's optimizer gained since
        they last followed it (see :meth:`LoopOptimizer.follow_groups`, which raises)."""
        self.optim.follow_groups(self.sync)

    def load_optimizer_state(self) -> None:
        """Move the state the user's optimizer holds (after its ``load_state_dict``) into
        the shards' optimizers."""
        self.optim.load_state(self.sync)
        self.touched()

    def optimizer_state(self) -> dict[Any, Any]:
        """Every shard optimizer's per-parameter state, keyed by parameter."""
        return self.optim.state()

    def sync(self) -> None:
        """Apply what is pending (as step ops) and bring every shard's state home, where
        it stays until the loop's next op: the user's thread may then read and write the
        model's parameters, gradients and buffers, and the optimizers' state.

        Raises:
            Exception: a deferred ``optimizer.step()`` (or ``zero_grad``) raised: as the
                next forward would raise it (once every other shard's work is applied).
        """
        if self._home.now or in_op() or self.closed:
            return
        error = loop_home.apply_pending(self.shards, self.run)  # ops: they end a hold
        self._home.enter()  # before: nothing of it is spilled on its way home either
        loop_home.bring_home(self.shards, self.engine.workers)
        self._home.now = not any(s.pending for s in self.shards)  # a failed step's: later
        if error is not None:
            raise error

    def touched(self) -> None:
        """The user's thread wrote into the model's or the optimizer's tensors at home:
        their host copies and spill files are stale (see ``ShardStore.begin_op``)."""
        self._home.wrote()

    def before_load(self, state_dict: Any) -> list[tuple[ShardStore, int]]:
        """Before ``load_state_dict(state_dict)`` writes into the model at home (after
        :meth:`sync`): see :func:`~tune_hydra.engine.runtime.loop_home.before_load`. Give
        what it returns to :meth:`after_load`."""
        return loop_home.before_load(self.stores, self.model, state_dict)

    def after_load(self, same: list[tuple[ShardStore, int]]) -> None:
        """After ``load_state_dict``: the shared tensors :meth:`before_load` found written
        with their own values stay shared."""
        loop_home.after_load(same)

    # -- torch.compile ----------------------------------------------------------------------

    def compile(self, compiler: Compiler | None) -> None:
        """Compile every shard's forward with ``compiler`` (``None``: eager again), from
        the next op on (see :func:`~tune_hydra.engine.runtime.compiled.recompile`)."""
        shards = [(s.module, s.index) for s in self.shards]
        self._compiler = recompile(self._compiler, compiler, shards, self.name, self._hf)
        self.random.set_compiled(self._compiler is not None)  # compiled code: global stream

    # -- leaving ---------------------------------------------------------------------------

    def close(self, *, raise_errors: bool = True) -> None:
        """Leave the engine: every state home for good, the runner removed (the model
        keeps its weights, on the CPU), and the shards' optimizers' state handed to the
        user's optimizer (plain training goes on from it). Pending steps are applied
        first.

        Args:
            raise_errors: raise the error of a pending step that failed (after leaving);
                ``False`` where the caller must not raise (a front end's clean-up): it
                is logged instead.

        Raises:
            Exception: with ``raise_errors``, a pending ``optimizer.step()`` raised (its
                own error, as the next forward would have raised it).
        """
        if self.closed:
            return
        error: Exception | None = None
        if not (self._home.now or in_op()):
            error = loop_home.apply_pending(self.shards, self.run)
        self._home.leave()
        self.closed = True
        if self._compiler is not None:  # the user's modules (blocks) called eagerly again
            self.compile(None)
        try:
            # Its states come home as the user's memory, out of the engine's host budget
            # (a sync would hold the whole task within it), read back from disk.
            self.engine.remove_task(self.name, runner=self)
        except Exception:
            log.warning("loop %r did not leave its engine", self.name, exc_info=True)
            loop_home.bring_home(self.shards, self.engine.workers)
        self.optim.hand_back()
        if error is None:
            return
        # TaskFailedError: the engine failed or cancelled the loop (closed before), which
        # the user's thread saw already; the loop's own (the user's step) reaches it here.
        if raise_errors and not isinstance(error, TaskFailedError):
            raise error
        log.warning(
            "th.unshard: loop %r left its engine without applying its last optimizer "
            "step(s): %s: %s",
            self.name,
            type(error).__name__,
            error,
            exc_info=error,
        )


def _owned(model: nn.Module | None, shards: list[LoopShard]) -> OwnedTensors:
    """What a loop trains (``Runner.owned_tensors``): its model's tensors, read from the
    stores' host copies where a shard is on a device."""
    if model is None:  # garbage-collected, its loop on its way out: it trains nothing
        return OwnedTensors()
    host: list[tuple[Any, torch.Tensor]] = []
    for s in shards:
        host.extend(s.store.host_tensors())
    return owned_tensors(model, host)


class LoopGraph:
    """The model's forward as one loop's shard ops (see "forward" and "kept graphs" in
    the module docstring): without grad plain ops; with grad each shard a node of the
    user's autograd graph (:class:`_ShardFunction`) whose backward runs the shard's
    backward op. Keeping graphs, it tracks the shard calls of the batch in progress,
    whose graphs wait on a device for their backward ops.

    Args:
        keep: the loop's forward ops keep their graphs for the backward (no recompute).
    """

    def __init__(self, keep: bool) -> None:
        self._keep = keep
        # The shard calls of the batch in progress that may keep a graph (weakly: the
        # user's autograd graph owns them).
        self._open: list[weakref.ref[ShardCall]] = []

    def forward(self, loop: LoopRunner, inputs: Any) -> Any:
        """``loop``'s model on ``inputs``, shard by shard, computed at ``loop.home`` and
        returned on the device of the inputs: with grad each shard's call a node of the
        user's graph (a training batch sized first: ``LoopSizing.fit``), else plain
        forward (or eval) ops.

        Raises:
            BatchTooLargeError: from ``LoopSizing.fit``.
        """
        grad = torch.is_grad_enabled() and any(
            p.requires_grad for s in loop.shards for p in s.module.parameters()
        )
        if grad:
            loop.sizing.fit(inputs)
        given = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
        user_device = given[0].device if given else loop.home
        carry = moved(inputs, loop.home)  # differentiable: the user's graph goes on from here
        if grad:
            carry = self._forward(loop, carry)
        else:
            kind = OpKind.FORWARD if loop.model.training else OpKind.EVAL
            for shard in loop.shards:
                carry = loop.run(kind, shard.index, _PlainForward(loop, shard, carry))
        return moved(carry, user_device)  # outputs on the device of the inputs

    def _forward(self, loop: LoopRunner, carry: Any) -> Any:
        """With grad: each shard's call a node of the user's graph."""
        token = torch.empty(0, requires_grad=True)  # so that every shard's node is reached
        graph = _Reach(token, loop.shards)
        token = graph.token
        if self._keep:  # the batches before are done (or were dropped by the user)
            self._open = [r for r in self._open if (c := r()) is not None and c.kept]
        for shard in loop.shards:
            call = ShardCall(loop, shard)
            call.reach = graph
            if self._keep:
                self._open.append(weakref.ref(call))
            leaves, spec = tree_flatten(carry)
            tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
            call.leaves, call.spec, call.tensor_at = leaves, spec, tensors
            outs = _ShardFunction.apply(call, token, *(leaves[i] for i in tensors))
            carry = call.rebuild(outs)
            # Only the pytrees' other leaves are needed again: holding the tensors
            # (outputs of the call's own node) would make a cycle through autograd's
            # nodes that a graph dropped without backward never frees.
            call.leaves = [None if i in tensors else t for i, t in enumerate(leaves)]
            call.out_leaves = [
                None if i in call.out_tensor_at else t for i, t in enumerate(call.out_leaves)
            ]
        return carry

    def track(self, call: ShardCall) -> None:
        """A shard call of the batch in progress that may keep a graph (a chain's: see
        :mod:`~tune_hydra.engine.runtime.loop_chain`)."""
        if self._keep:
            self._open = [r for r in self._open if (c := r()) is not None and c.kept]
            self._open.append(weakref.ref(call))

    def drop(self) -> None:
        """Drop the graphs the batch in progress keeps on a device; saved inputs of a
        recompute belong to the user's autograd graph."""
        for ref in self._open:
            call = ref()
            if call is not None:
                call.kept = None
        self._open = []

    def keeps(self) -> bool:
        """Whether a forward's graph of the batch in progress is kept for a backward still
        to come."""
        return any((c := r()) is not None and c.kept is not None for r in self._open)


class _PlainForward:
    """A shard's forward without grad (evaluation, ``torch.no_grad()``): keeps nothing."""

    def __init__(self, loop: LoopRunner, shard: LoopShard, x: Any) -> None:
        self.loop, self.shard, self.x = loop, shard, x

    def __call__(self, device: torch.device) -> Any:
        loop, shard = self.loop, self.shard
        x = moved(self.x, device)
        with loop.random.drawing(shard, device, loop.model.training), torch.no_grad():
            out = shard.module(x)
        return moved(out, loop.home)


class _ParamsProbe(torch.autograd.Function):
    """The token every shard's node of a forward takes, made from the model's trainable
    parameters: so that ``torch.autograd.grad(loss, params)`` (or
    ``loss.backward(inputs=params)``) reaches the shards' nodes, which refuse it (see
    :class:`_Reach`) instead of torch's "not used in the graph" (or ``None``, or zeros,
    with ``allow_unused``). It hands back no gradient: ``loss.backward()`` leaves the
    parameters' ``.grad`` to the shards' backward ops."""

    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return torch.empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (None,) * len(ctx.needs_input_grad)


class _Reach:
    """What the backward pass running a forward's shards' nodes asks for. The token's own
    node runs only in a full ``backward()`` (no ``inputs=``): any other pass
    (``torch.autograd.grad``, ``backward(inputs=...)``) wants the gradients of some
    tensors only, and the shards' parameters must not accumulate any (inputs only); the
    probe's node runs when such a pass wants parameters' gradients (refused).

    A parameter with a hook (``register_hook``, ``register_post_accumulate_grad_hook``)
    is left out of the probe: autograd would call its hooks on every ``backward()`` with
    no gradient. For it torch's own "not used in the graph" error stays."""

    def __init__(self, token: torch.Tensor, shards: list[LoopShard]) -> None:
        self.full = torch.autograd.graph.get_gradient_edge(token).node
        seen: set[int] = set()
        params = []
        for s in shards:
            for p in s.module.parameters():
                hooked = p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
                if p.requires_grad and not hooked and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.token = _ParamsProbe.apply(token, *params) if params else token
        self.params = self.token.grad_fn if params else None

    def inputs_only(self) -> bool:
        """Called in a shard's backward: whether this pass wants inputs' gradients only.

        Raises:
            UnsupportedCallError: it wants the parameters' gradients (``autograd.grad``
                w.r.t. them, ``backward(inputs=params)``), or a graph of the gradients
                (``create_graph=True``: double backward, a gradient penalty).
        """
        if torch.is_grad_enabled():  # the backward runs with grad: create_graph=True
            raise UnsupportedCallError(
                "a sharded model does not support double backward (create_graph=True, as "
                "a gradient penalty's torch.autograd.grad(out, x, create_graph=True) "
                "needs): its backward ops run on the engine's devices and build no graph "
                "of the gradients. Compute such a term on a plain (unsharded) model, or "
                "use a penalty that needs no gradient of a gradient"
            )
        will = getattr(torch._C, "_will_engine_execute_node", None)
        if will is None or will(self.full):
            return False
        if self.params is not None and will(self.params):
            raise UnsupportedCallError(
                "gradients w.r.t. a sharded model's parameters are not given by "
                "torch.autograd.grad or backward(inputs=params): the engine accumulates "
                "them into the parameters' .grad on its devices. Call loss.backward() and "
                "read p.grad for p in model.parameters() (zero_grad() first); "
                "torch.autograd.grad w.r.t. the model's inputs is supported"
            )
        return True


class ShardCall:
    """One shard's part in one forward with grad: runs its forward op, keeps its input,
    and runs its backward op when autograd reaches it."""

    def __init__(self, loop: LoopRunner, shard: LoopShard) -> None:
        self.loop = loop
        self.shard = shard
        self.leaves: list[Any] = []
        self.spec: Any = None
        self.tensor_at: list[int] = []
        self.entry: Entry | None = None  # the RNG state the forward started from
        self.autocast: amp.Autocast | None = None  # the forward's (a recompute's too)
        self.out_spec: Any = None
        self.out_leaves: list[Any] = []
        self.out_tensor_at: list[int] = []
        self.training = True
        self.steps = 0  # the shard's optimizer steps when the forward ran
        self.reach: _Reach | None = None  # what a backward pass asks of the forward
        # With kept graphs: the forward's inputs (leaves on the device) and its outputs,
        # whose graph the backward op back-propagates through (once: a second backward,
        # retain_graph=True, recomputes from the saved input).
        self.kept: tuple[list[torch.Tensor], Any] | None = None
        # Of a chain's call (tune_hydra.engine.runtime.loop_chain): the inputs it saves for
        # the recomputing backward, and which of them need a gradient.
        self.saved: tuple[torch.Tensor, ...] = ()
        self.need: tuple[bool, ...] = ()

    def inputs(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, self.spec)

    def rebuild(self, outs: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves)
        for i, t in zip(self.out_tensor_at, outs, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, self.out_spec)

    def forward(self, tensors: tuple[torch.Tensor, ...], need: Any) -> list[torch.Tensor]:
        loop, shard = self.loop, self.shard
        self.training = loop.model.training
        self.autocast = amp.current()
        x = self.inputs(tensors)

        def keep(device: torch.device) -> Any:
            return self.keep_forward(tensors, need, device)

        out = loop.run(OpKind.FORWARD, shard.index, keep if loop.keep else ForwardOp(self, x))
        return self.take_output(out)

    def begin(self, x: Any, first: bool, autocast: amp.Autocast | None) -> tuple[torch.Tensor, ...]:
        """A chain's forward op will run on ``x`` (``first``: the batch's inputs, into
        which no gradient flows) under ``autocast``: note its inputs; returns their
        tensors."""
        leaves, self.spec = tree_flatten(x)
        self.tensor_at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self.leaves = leaves
        self.saved = tuple(leaves[i] for i in self.tensor_at)
        self.need = tuple(not first and t.is_floating_point() for t in self.saved)
        self.training = self.loop.model.training
        self.autocast = autocast
        return self.saved

    def keep_forward(
        self, tensors: tuple[torch.Tensor, ...], need: Any, device: torch.device
    ) -> Any:
        """A forward op that keeps its graph on ``device`` for the backward op; returns
        the output, detached, at home."""
        loop, shard = self.loop, self.shard
        inp = input_leaves(tensors, need, device)
        arg = self.inputs(
            tuple(clone_tensors(t) if shard.writes_input is not False else t for t in inp)
        )
        with (
            loop.random.drawing(shard, device, loop.model.training) as entry,
            torch.enable_grad(),
        ):
            out = shard.module(arg)
        self.kept = (inp, out)
        self.entry = entry  # a second backward (retain_graph=True) recomputes
        self.steps = shard.steps
        return moved(_detached(out), loop.home)

    def take_output(self, out: Any) -> list[torch.Tensor]:
        """Note the forward's output structure (its backward's gradients follow it);
        returns its tensors."""
        leaves, self.out_spec = tree_flatten(out)
        self.out_tensor_at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        self.out_leaves = leaves
        return [leaves[i] for i in self.out_tensor_at]

    def backward(
        self,
        saved: tuple[torch.Tensor, ...],
        grads: tuple[torch.Tensor | None, ...],
        need: Any,
        inputs_only: bool = False,
    ) -> list[torch.Tensor | None]:
        """The backward op; ``inputs_only``: the inputs' gradients alone, the parameters'
        ``.grad`` untouched (``torch.autograd.grad`` w.r.t. inputs)."""
        loop, shard = self.loop, self.shard
        compute = BackwardOp(self, saved, grads, need, inputs_only)

        def kept(device: torch.device) -> list[torch.Tensor | None]:
            return self.kept_backward(grads, need, inputs_only, device, compute)

        # The input pytree's other leaves (self.leaves) stay: a retained graph's second
        # backward recomputes from them again.
        try:
            grads_in: list[torch.Tensor | None] = loop.run(
                OpKind.BACKWARD,
                shard.index,
                kept if loop.keep and self.kept is not None else compute,
            )
            return grads_in
        finally:
            self.out_leaves = []  # the graph is done with them

    def kept_backward(
        self,
        grads: tuple[torch.Tensor | None, ...],
        need: Any,
        inputs_only: bool,
        device: torch.device,
        compute: Callable[[torch.device], list[torch.Tensor | None]],
    ) -> list[torch.Tensor | None]:
        """A backward op through the graph the forward kept (``compute``: the recompute,
        when it was back-propagated already, ``retain_graph=True``, or dropped)."""
        if self.kept is None:
            return compute(device)
        shard = self.shard
        uses = ([], []) if inputs_only else (shard.first_uses, shard.last_uses)
        inp, out = self.kept
        for store, i in uses[0]:
            store.stash_grad(i)
        self._back_propagate(out, grads, device, inp if inputs_only else None)
        for store, i in uses[1]:
            store.unstash_grad(i)
        self.kept = None
        return [
            None if t.grad is None else t.grad.to(self.loop.home) if n else None
            for t, n in zip(inp, need, strict=True)
        ]

    def _back_propagate(
        self,
        out: Any,
        grads: tuple[torch.Tensor | None, ...],
        device: torch.device,
        inputs: list[torch.Tensor] | None = None,
    ) -> None:
        """Back-propagate ``out``'s graph from ``grads``: into the shard's parameters and
        its input leaves, or with ``inputs`` into those alone."""
        outs, _ = tree_flatten(out)
        outs = [outs[i] for i in self.out_tensor_at]
        gs = [None if g is None else g.to(device) for g in grads]
        # On this thread, not autograd's per-device thread: with CUDA inputs the user's
        # loss.backward() runs this node there, waiting for this op (a deadlock).
        with torch.autograd.set_multithreading_enabled(False):
            if inputs is None:
                backward_from(outs, gs)
                return
            pairs = [
                (o, g) for o, g in zip(outs, gs, strict=True) if o.requires_grad and g is not None
            ]
            wanted = [t for t in inputs if t.requires_grad]
            if pairs and wanted:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=wanted)


class ForwardOp:
    """A recomputing forward op's compute: the shard without grad (its input is kept by
    the autograd node for the recompute). A batched pass may compute it with other
    loops' ops instead (:meth:`start`, then :meth:`take`)."""

    def __init__(self, call: ShardCall, x: Any) -> None:
        self.call = call
        self.x = x

    def __call__(self, device: torch.device) -> Any:
        call = self.call
        loop, shard = call.loop, call.shard
        arg = moved(self.x, device)
        if shard.writes_input is not False:  # the saved input must stay as it was
            arg = clone_tensors(arg)
        with loop.random.drawing(shard, device, loop.model.training) as entry, torch.no_grad():
            out = shard.module(arg)
        call.entry = entry
        call.steps = shard.steps
        return moved(out, loop.home)

    def start(self, device: torch.device) -> OpStart:
        gen = self.call.loop.random.op_gen
        return OpStart(_detached(moved(self.x, device)), rng.RngState(gen.get_state()))

    def take(self, start: OpStart, out: Any, cpu_after: torch.Tensor) -> Any:
        call = self.call
        call.loop.random.op_gen.set_state(cpu_after)  # the stream went on as in the pass
        call.entry = Entry(start.stream.cpu)
        call.steps = call.shard.steps
        # Tensor objects of its own: an output the pass computed from what the trials
        # share (rotary cos/sin) is one tensor for all of them, and a tensor returned by
        # this loop's autograd node must not be another loop's node's output too (its
        # grad_fn would be the last one's: one loop's backward would run another's op).
        return moved(_detached(out), call.loop.home)


class BackwardOp:
    """A recomputing backward op's compute: the shard's forward again, with grad, on the
    random numbers and under the autocast of its forward, back-propagated from the
    output's gradient. A batched pass may compute it with other loops' ops instead
    (:meth:`start`, then :meth:`take`)."""

    def __init__(
        self,
        call: ShardCall,
        saved: tuple[torch.Tensor, ...],
        grads: tuple[torch.Tensor | None, ...],
        need: Any,
        inputs_only: bool,
    ) -> None:
        self.call = call
        self.saved = saved
        self.grads = grads
        self.need = need
        self.inputs_only = inputs_only
        self._inp: list[torch.Tensor] = []  # start's input leaves (take reads them)

    def _check_steps(self) -> None:
        if self.call.shard.steps != self.call.steps:
            raise UnsupportedCallError(
                "a backward through a sharded model's forward came after "
                "optimizer.step() changed its parameters: it would recompute that "
                "forward with the new weights (plain PyTorch raises that a variable "
                "needed for gradient computation was modified by an inplace "
                "operation). Call backward() before step(), or run the forward again"
            )

    def __call__(self, device: torch.device) -> list[torch.Tensor | None]:
        call = self.call
        loop, shard = call.loop, call.shard
        uses = ([], []) if self.inputs_only else (shard.first_uses, shard.last_uses)
        self._check_steps()
        inp = input_leaves(self.saved, self.need, device)
        arg = call.inputs(tuple(clone_tensors(t) if shard.writes_input else t for t in inp))
        for store, i in uses[0]:
            store.stash_grad(i)
        with (
            _scratch_buffers(shard),
            loop.random.replay(call.entry, device),
            amp.entered(call.autocast),
            torch.enable_grad(),
        ):
            out = shard.module(arg)
        call._back_propagate(out, self.grads, device, inp if self.inputs_only else None)
        for store, i in uses[1]:
            store.unstash_grad(i)
        return [
            None if t.grad is None else t.grad.to(loop.home) if n else None
            for t, n in zip(inp, self.need, strict=True)
        ]

    def start(self, device: torch.device) -> OpStart:
        call = self.call
        self._check_steps()
        inp = self._inp = input_leaves(self.saved, self.need, device)
        entry = call.entry
        # A forward that drew nothing recorded no state: its recompute draws nothing.
        cpu = entry.cpu if entry is not None and entry.cpu is not None else None
        stream = rng.RngState(torch.Generator().get_state() if cpu is None else cpu)
        # The output's gradient, leaf for leaf as the output flattens.
        grad: list[Any] = [None] * len(call.out_leaves)
        for i, g in zip(call.out_tensor_at, self.grads, strict=True):
            grad[i] = None if g is None else g.to(device)
        params = [p for p in call.shard.module.parameters() if p.requires_grad]
        wrt = [*params, *(t for t in inp if t.requires_grad)]
        return OpStart(call.inputs(tuple(inp)), stream, grad=grad, wrt=wrt)

    def take(self, start: OpStart, grads: Sequence[torch.Tensor | None]) -> list[Any]:
        home = self.call.loop.home
        n_params = len(start.wrt) - sum(t.requires_grad for t in self._inp)
        for t, g in zip(start.wrt[:n_params], grads[:n_params], strict=True):
            accumulate_grad(t, g)
        mine = iter(grads[n_params:])
        out: list[Any] = []
        for t, n in zip(self._inp, self.need, strict=True):
            g = next(mine) if t.requires_grad else None
            out.append(None if g is None or not n else g.to(home))
        return out


@contextlib.contextmanager
def _scratch_buffers(shard: LoopShard) -> Iterator[None]:
    """A recompute's buffers: the forward already updated them (BatchNorm statistics)
    once, so the recompute runs on throwaway copies and the real ones are put back."""
    slots = [(m, n) for part in shard.store.parts() for m, n in part.buffer_slots]
    real = [m._buffers[n] for m, n in slots]
    for (m, n), b in zip(slots, real, strict=True):
        m._buffers[n] = b.clone()  # type: ignore[union-attr]
    try:
        yield
    finally:
        for (m, n), b in zip(slots, real, strict=True):
            m._buffers[n] = b


class _ShardFunction(torch.autograd.Function):
    """A shard in the user's autograd graph (see :class:`ShardCall`)."""

    @staticmethod
    def forward(ctx: Any, call: ShardCall, token: torch.Tensor, *tensors: torch.Tensor) -> Any:
        outs = call.forward(tensors, ctx.needs_input_grad[2:])
        ctx.call = call
        # The token too: autograd frees what is saved after a backward without
        # retain_graph, so that a second one raises torch's own error; with kept graphs as
        # well: a retained graph's second backward recomputes from the inputs.
        ctx.save_for_backward(token, *tensors)
        ctx.set_materialize_grads(False)
        frozen = [t for t in outs if not (t.is_floating_point() or t.is_complex())]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        call: ShardCall = ctx.call
        # Raises torch's "Trying to backward through the graph a second time" once a
        # backward without retain_graph=True freed them.
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]
        inputs_only = call.reach is not None and call.reach.inputs_only()
        got = call.backward(saved[1:], grads, need, inputs_only)
        return (None, None, *got)


class _Given:
    """The :class:`ChainOp` of :meth:`LoopRunner.run`'s one op: its compute as given."""

    def __init__(self, fn: Callable[[torch.device], Any]) -> None:
        self.fn = fn

    def bind(self, value: Any) -> Callable[[torch.device], Any]:
        return self.fn


def _may_draw(loop: LoopRunner, kind: OpKind, shard: int) -> bool:
    """Whether an op may draw random numbers (a backward replays a saved state; a step
    draws nothing; a shard seen not to draw does not)."""
    return (
        kind in (OpKind.FORWARD, OpKind.EVAL, OpKind.LAST)
        and loop.shards[shard].draws.get(loop.model.training) is not False
    )


def moved(obj: Any, device: torch.device) -> Any:
    leaves, spec = tree_flatten(obj)
    if not any(isinstance(t, torch.Tensor) and t.device != device for t in leaves):
        return obj
    moved = [t.to(device) if isinstance(t, torch.Tensor) else t for t in leaves]
    return tree_unflatten(moved, spec)


def input_leaves(tensors: Any, need: Any, device: torch.device) -> list[torch.Tensor]:
    """A shard's inputs on ``device`` as leaves of its graph (those whose gradient is
    needed require it)."""
    return [
        t.detach().to(device).requires_grad_(bool(n) and t.is_floating_point())
        for t, n in zip(tensors, need, strict=True)
    ]


def _detached(obj: Any) -> Any:
    """``obj``'s tensors detached from the graph a kept forward made (sharing memory and
    version counters: an in-place write by the user's code is caught as in plain)."""
    leaves, spec = tree_flatten(obj)
    return tree_unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in leaves], spec)


def clone_tensors(obj: Any) -> Any:
    leaves, spec = tree_flatten(obj)
    return tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec)


def loop_costs(
    layers: list[tuple[str, nn.Module]],
    sample: Any,
    user_optimizer: torch.optim.Optimizer | None,
    optimizer_class: type[torch.optim.Optimizer] | None,
    device: torch.device,
    name: str,
) -> list[LayerCost]:
    """The layers' costs a loop's cut is made from (:func:`build_loop`, and
    ``th.plan(model, sample)``, which must find the same cut): probed on ``sample``,
    optimizer state counted with an optimizer like the user's (none: SGD, no state).

    Raises:
        DataMismatchError: a layer raises on ``sample``.
    """

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return (
            torch.optim.SGD(params, lr=0.0)
            if optimizer_class is None
            else optimizer_like(user_optimizer, optimizer_class, [{"params": params}])
        )

    # The probe's draws come from a throwaway generator: no stream (nor torch's global
    # generator, which other threads draw from) sees them.
    with use_generator(torch.Generator()), inside_op():
        return layer_costs(layers, factory, sample, None, device=device, task=name)


def build_loop(
    engine: Engine,
    model: nn.Module,
    user_optimizer: torch.optim.Optimizer | None,
    optimizer_class: type[torch.optim.Optimizer] | None,
    layers: list[tuple[str, nn.Module]],
    sample: Any,
    *,
    hf: bool,
    rng_start: torch.Tensor,
    compiler: Compiler | None = None,
    name: str | None = None,
) -> LoopRunner:
    """Cut ``model`` (its ``layers``, sized by a probe on ``sample``, the first batch) for
    ``engine``'s budget, build one optimizer per shard like the user's, and register the
    loop with the engine; with ``compiler`` (the user's ``torch.compile`` settings) each
    shard's forward is compiled (:meth:`LoopRunner.compile`).

    Raises:
        ShardTooLargeError, DataMismatchError, InvalidModelError: from the cut.
        SharedShardModelError: the model trains tensors another task of ``engine`` trains
            (a submodule shared with another sharded model); nothing of the loop stays,
            and the optimizer keeps its state.
    """
    if name is None:
        name = f"loop-{type(model).__name__}-{next(_NAMES)}"
    costs = loop_costs(layers, sample, user_optimizer, optimizer_class, engine.devices[0], name)
    device = engine.devices[0]
    budget = device_budget(device, engine.budget)  # as the engine's workers budget
    plan = plan_shards(
        costs,
        budget,
        prefetch=engine.prefetch,
        max_layers_per_shard=engine.max_layers_per_shard,
        # Where a loop sharing its frozen base was cut (LoRA trials of one search), if it fits.
        prefer=engine.shared_cuts(model, [c.name for c in costs]),
        kept=not engine.recompute and engine.keeps_graphs,
    )
    keep = keeps_graphs(engine, plan)
    modules = [nn.Sequential(*(m for _, m in layers[s.start : s.stop])) for s in plan.shards]
    shared = SharedParams(modules)
    optimizers: list[torch.optim.Optimizer | None] = []
    maps: list[list[int]] = []
    for spec, module in zip(plan.shards, modules, strict=True):
        params = {id(p) for p in shared.steps(spec.index, module)}
        groups, gmap = [], []
        if user_optimizer is not None and optimizer_class is not None:
            for gi, g in enumerate(user_optimizer.param_groups):
                ps = [p for p in g["params"] if id(p) in params]
                if ps:
                    groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
                    gmap.append(gi)
        opt = (
            optimizer_like(user_optimizer, optimizer_class, groups)
            if optimizer_class and groups
            else None
        )
        if opt is not None and user_optimizer is not None:  # state loaded before the cut
            for g in opt.param_groups:
                for p in g["params"]:
                    if p in user_optimizer.state:
                        opt.state[p] = user_optimizer.state.pop(p)
        optimizers.append(opt)
        maps.append(gmap)
    pin = any(d.type == "cuda" for d in engine.devices)
    host = engine.host

    def spill(key: tuple[str, int]) -> dict[str, Any]:
        # With a host budget, the disk tier below it (as a ModelTask's stores have).
        if not host.active or host.folder is None:
            return {}
        return {"host": host, "spill_file": host.folder.file(key)}

    stores = shared.stores(optimizers, pin=pin, task=name, spill=spill)
    shards = []
    for spec, module, opt, gmap in zip(plan.shards, modules, optimizers, maps, strict=True):
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
        shards.append(
            LoopShard(
                spec.index,
                module,
                opt,
                LinkedStore(own, links) if links else own,
                gmap,
                shared.zeroes(spec.index, module),
                shared.first_uses(spec.index, stores),
                shared.last_uses(spec.index, stores),
                spec.writes_input,
            )
        )
    user = {id(m) for m in model.modules()}
    wrappers = [m for mod in modules for m in mod.modules() if id(m) not in user]
    runner = LoopRunner(
        name,
        engine,
        model,
        plan,
        shards,
        user_optimizer,
        wrappers,
        rng_start=rng_start,
        hf=hf,
        keep=keep,
        optimizer_class=optimizer_class,
        probe_bytes=tensor_bytes(sample),
    )
    if compiler is not None:
        runner.compile(compiler)
    # recompute=True: the engine reserves nothing for this loop's batches (and does not
    # refuse a batch too big to keep: the loop recomputes it).
    try:
        engine.add_runner(name, runner, options=TrainOptions(recompute=not keep, where=name))
    except BaseException as err:
        # Refused: the state loaded before the cut goes back to the user's optimizer.
        if user_optimizer is not None:
            for opt in optimizers:
                if opt is not None:
                    user_optimizer.state.update(opt.state)
        if isinstance(err, SharedModelError) and not isinstance(err, SharedShardModelError):
            raise SharedShardModelError(err.task, err.owner, err.tensors) from None
        raise
    return runner


def keeps_graphs(engine: Engine, plan: ShardPlan) -> bool:
    """Whether a loop of ``plan`` keeps its forward graphs on ``engine``: when the engine
    keeps graphs (``recompute=False``) and, on devices that copy, one batch with every
    shard's activations kept fits the device budget; else it recomputes."""
    if engine.recompute:
        return False
    budget = plan.budget
    if engine.keeps_graphs and budget is not None and plan.kept_peak_bytes() > budget:
        log.info(
            "a th.shard loop recomputes its forwards in backward: keeping all %d shards' "
            "activations (%s) would not fit device_memory=%s",
            len(plan),
            format_bytes(plan.kept_peak_bytes()),
            format_bytes(budget),
        )
        return False
    return True


__all__ = [
    "BackwardOp",
    "ChainOp",
    "ChainStep",
    "ForwardOp",
    "LoopGraph",
    "LoopRunner",
    "LoopShard",
    "ShardCall",
    "build_loop",
    "clone_tensors",
    "in_op",
    "input_leaves",
    "inside_op",
    "keeps_graphs",
    "loop_costs",
    "moved",
]
