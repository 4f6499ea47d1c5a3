"""Running one shard operation of a task: a forward, a backward, or an eval step.

Training is arranged to equal plain PyTorch exactly:

- forward keeps each shard's input (and the RNG state before it); the last shard's visit
  computes the loss and its own backward; every other shard's backward re-runs its
  forward from the saved input with the saved RNG state (same dropout masks) and its
  buffers restored afterwards (BatchNorm statistics are updated once, as in plain
  training) -- or, with ``recompute=False``, keeps the forward's graph instead;
- the task's RNG stream is installed in torch's global generators around each shard's
  compute (not at all for shards seen not to draw).

An operation runs a group of micro-batches (one unless visits are grouped); each one's
boundary tensor (a *carry*: the activation into a forward, the gradient into a backward)
is replaced in the caller's list by what the shard hands on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from tune_hydra.engine.runtime import amp, rng
from tune_hydra.engine.runtime.boundary import (
    SavedInput,
    backward,
    clone,
    detach,
    grads_of,
    to_device,
    versions,
)
from tune_hydra.engine.runtime.metrics import MetricTotals
from tune_hydra.exceptions import InvalidModelError

if TYPE_CHECKING:
    from tune_hydra.engine.runtime.checks import BatchChecks
    from tune_hydra.engine.runtime.optim import Stepper
    from tune_hydra.engine.runtime.runner import ShardRuntime

_NULL = contextlib.nullcontext()  # reusable: nullcontext keeps no state


@dataclass
class OpStart:
    """What micro-batch 0's forward or recomputing backward through a shard starts from,
    for computing it outside the stage (a batched pass: :mod:`~tune_hydra.engine.dispatch.batched`)
    and handing the result back with :meth:`Stage.forward_taken` or
    :meth:`Stage.backward_taken`. Making it changes nothing of the task."""

    input: Any  # on the device; for a backward of a shard after the first, leaves needing grad
    stream: rng.RngState  # the task's RNG stream at the op's start (replayed by a backward)
    saved: SavedInput | None = None  # a forward's input, kept for its recompute
    grad: Any = None  # a backward's gradient of the shard's output, on the device
    # A backward's: the shard's trainable parameters and input leaves, whose gradients
    # it hands back (in this order).
    wrt: list[torch.Tensor] = field(default_factory=list)


def accumulate_grad(t: torch.Tensor, g: torch.Tensor | None) -> None:
    """Add ``g`` into ``t.grad`` as autograd's accumulation does (the first gradient is
    taken as it is, a later one added in place), so the result is bit for bit what a
    ``backward`` would have left; None (not reached) leaves it as it is."""
    if g is None:
        return
    if t.grad is None:
        t.grad = g
    else:
        with torch.no_grad():
            t.grad += g


class Stage:
    """Runs one task's shard operations on the device each is given.

    Args:
        name: the task's name, for the errors.
        stream: the task's RNG stream, advanced in place.
        checks: the checks of the task's batches and losses.
        stepper: the task's optimizer stepping.
        seed: the task's seed (for the RNG stream's generators not seeded yet).
        accumulate_steps: backward passes per optimizer step (the loss is divided by it).
        recompute: re-run each forward for its backward instead of keeping its graph.
        precision: ``"bf16"`` for bfloat16 autocast; None for none.
    """

    def __init__(
        self,
        name: str,
        stream: rng.RngState,
        checks: BatchChecks,
        stepper: Stepper,
        *,
        seed: int,
        accumulate_steps: int,
        recompute: bool,
        precision: str | None,
    ) -> None:
        self.name = name
        self._stream_state = stream
        self._checks = checks
        self._stepper = stepper
        self._seed = seed
        self._accumulate = accumulate_steps
        self._recompute = recompute
        self._autocast_dtype = torch.bfloat16 if precision == "bf16" else None
        # Per shard, per micro-batch of the group: what its backward needs.
        self._inputs: dict[int, list[Any]] = {}
        self._rng_at: dict[int, list[rng.RngState | None]] = {}
        self._outputs: dict[int, list[Any]] = {}

    @property
    def autocasts(self) -> bool:
        """Whether the shard ops compute under bf16 autocast."""
        return self._autocast_dtype is not None

    @property
    def outputs(self) -> dict[int, list[Any]]:
        """The outputs of the forwards whose graphs are kept for the backward, per shard
        (read only)."""
        return self._outputs

    def drop_batch(self) -> None:
        """Let go of the saved inputs and kept graphs of the batch in progress."""
        self._inputs, self._outputs, self._rng_at = {}, {}, {}

    # -- training ---------------------------------------------------------------------

    def forward(
        self, shard: ShardRuntime, device: torch.device, carries: list[Any], batch: int
    ) -> None:
        """The group's forward through ``shard`` (not the last); ``batch`` is the
        group's first batch of the epoch. Each carry becomes the shard's output."""
        i = shard.index
        self._inputs[i], self._outputs[i], self._rng_at[i] = [], [], []
        for j in range(len(carries)):
            self._forward(shard, device, carries, batch + j, j)

    def forward_loss(
        self,
        shard: ShardRuntime,
        device: torch.device,
        carries: list[Any],
        targets: list[Any],
        batch: int,
    ) -> list[float]:
        """The group's forward through the last shard, the loss and its backward. Each
        carry becomes the gradient of the shard's input (None for a model of one
        shard). Returns each micro-batch's loss."""
        i = shard.index
        self._inputs[i], self._outputs[i], self._rng_at[i] = [], [], []
        return [
            self._forward_loss(shard, device, carries, targets[j], batch + j, j)
            for j in range(len(carries))
        ]

    def backward(
        self, shard: ShardRuntime, device: torch.device, carries: list[Any], batch: int, count: int
    ) -> None:
        """The backward of ``count`` micro-batches through ``shard``, in order, so that
        gradients accumulate in plain training's order. Each carry (the gradient of the
        shard's output) becomes the gradient of its input (None for the first shard)."""
        for j in range(count):
            self._backward(shard, device, carries, batch + j, j)

    def _forward(
        self, shard: ShardRuntime, device: torch.device, carries: list[Any], batch: int, j: int
    ) -> None:
        """Micro-batch ``j`` of the group (batch ``batch`` of the epoch) through ``shard``."""
        i = shard.index
        # Held from here on device: the copy another device had is freed at once.
        x = carries[j] = to_device(carries[j], device)
        keep_graph = not self._recompute
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
                out = self._checks.call(shard, arg, batch, train=True)
        self._check_writes(shard, arg, before)
        self._inputs[i].append(inp if keep_graph else saved)
        if keep_graph:
            self._outputs[i].append(out)
            out = detach(out, requires_grad=False)
        carries[j] = out

    def _forward_loss(
        self,
        shard: ShardRuntime,
        device: torch.device,
        carries: list[Any],
        target: Any,
        batch: int,
        j: int,
    ) -> float:
        """Micro-batch ``j`` through the last shard, its loss and backward."""
        i = shard.index
        x = carries[j] = to_device(carries[j], device)
        k = self._accumulate
        inp = detach(x, requires_grad=i > 0)
        arg, before = self._argument(shard, inp)
        with self._stream(shard, device) as entry:
            self._rng_at[i].append(entry)
            grad_mode = _NULL if torch.is_grad_enabled() else torch.set_grad_enabled(True)
            with grad_mode, self._autocast(device):
                out = self._checks.call(shard, arg, batch, train=True)
                target = to_device(target, device)
                loss = self._checks.loss(out, target, batch, train=True)
        self._check_writes(shard, arg, before)
        value = float(loss.item())
        self._checks.finite(value, batch)
        self._stepper.before_backward(shard, batch)
        try:
            # loss / 1 is loss bit for bit; skipping it saves an op and an autograd node
            (loss / k if k > 1 else loss).backward()
        except Exception as err:
            mismatch = self._checks.backward_error(err, out, target, batch)
            if mismatch is None:
                raise
            raise mismatch from err
        carries[j] = grads_of(inp) if i > 0 else None
        self._stepper.after_backward(shard, batch)
        return value

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

    def _backward(
        self, shard: ShardRuntime, device: torch.device, carries: list[Any], batch: int, j: int
    ) -> None:
        """Micro-batch ``j``'s backward through ``shard``."""
        i = shard.index
        grad_out = carries[j] = to_device(carries[j], device)
        self._stepper.before_backward(shard, batch)
        if self._recompute:
            inp = detach(self._inputs[i][j].get(device), requires_grad=i > 0)
            arg = clone(inp) if shard.mutates_input else inp
            replay = self._rng_at[i][j]
            with (
                self.scratch_buffers(shard),
                self._stream(shard, device, replay=replay),
                torch.enable_grad(),
                self._autocast(device),
            ):
                out = shard.module(arg)
        else:
            inp, out = self._inputs[i][j], self._outputs[i][j]
        backward(out, grad_out)
        carries[j] = grads_of(inp) if i > 0 else None
        self._stepper.after_backward(shard, batch)
        if j == len(carries) - 1:  # the group's last: free its saved tensors
            for store in (self._inputs, self._outputs, self._rng_at):
                store.pop(i, None)

    @staticmethod
    @contextlib.contextmanager
    def scratch_buffers(shard: ShardRuntime) -> Iterator[None]:
        """A recompute's buffers: the forward already updated them (BatchNorm
        statistics) once, so the recompute runs on throwaway copies and the real ones
        are put back after."""
        slots = shard.store.buffer_slots
        real = [mod._buffers[name] for mod, name in slots]
        for (mod, name), b in zip(slots, real, strict=True):
            mod._buffers[name] = b.clone()  # type: ignore[union-attr]
        try:
            yield
        finally:
            for (mod, name), b in zip(slots, real, strict=True):
                mod._buffers[name] = b

    # -- an op computed outside the stage (engine/dispatch/batched.py) ---------------------------

    def _stream_copy(self) -> rng.RngState:
        return rng.RngState(self._stream_state.cpu.clone(), self._stream_state.cuda)

    def forward_start(self, device: torch.device, carry: Any) -> OpStart:
        """What a forward of ``carry`` (micro-batch 0, not the last shard) starts from,
        with its recompute in mind: the input detached on ``device`` and saved."""
        inp = detach(to_device(carry, device), requires_grad=False)
        # Issued before the forward's kernels so the copy overlaps them (as _forward).
        return OpStart(inp, self._stream_copy(), saved=SavedInput(inp, device))

    def forward_taken(
        self, shard: ShardRuntime, start: OpStart, out: Any, cpu_after: torch.Tensor
    ) -> Any:
        """Take micro-batch 0's forward through ``shard`` computed from ``start``: it
        gave ``out`` and left the CPU generator at ``cpu_after``. Keeps what its
        recomputing backward needs and advances the task's stream, as :meth:`forward`
        does; returns ``out`` (the carry)."""
        i = shard.index
        if shard.cpu_rng is None:
            shard.cpu_rng = not torch.equal(cpu_after, start.stream.cpu)
        self._inputs[i] = [start.saved]
        self._outputs[i] = []
        self._rng_at[i] = [start.stream if shard.cpu_rng is not False else None]
        self._stream_state.cpu = cpu_after
        return out

    def backward_start(self, shard: ShardRuntime, device: torch.device, carry: Any) -> OpStart:
        """What micro-batch 0's recomputing backward through ``shard`` starts from, with
        ``carry`` the gradient of its output: the saved input as new leaves, the RNG
        state its forward started from, the tensors whose gradients it hands back."""
        i = shard.index
        inp = detach(self._inputs[i][0].get(device), requires_grad=i > 0)
        replay = self._rng_at[i][0]
        # A forward that drew nothing recorded no state: its recompute draws nothing.
        stream = replay if replay is not None else self._stream_copy()
        params = [p for p in shard.module.parameters() if p.requires_grad]
        leaves = [t for t in tree_flatten(inp)[0] if isinstance(t, torch.Tensor)]
        wrt = [*params, *(t for t in leaves if t.requires_grad)]
        return OpStart(inp, stream, grad=to_device(carry, device), wrt=wrt)

    def backward_taken(
        self,
        shard: ShardRuntime,
        start: OpStart,
        grads: Sequence[torch.Tensor | None],
        batch: int,
    ) -> Any:
        """Take micro-batch 0's backward through ``shard`` computed from ``start``:
        ``grads`` are the gradients of ``start.wrt``. They accumulate as autograd's
        backward does, between the stepper's calls, as :meth:`backward`; returns the
        input's gradient (the carry; None for the first shard)."""
        i = shard.index
        try:
            self._stepper.before_backward(shard, batch)
            for t, g in zip(start.wrt, grads, strict=True):
                accumulate_grad(t, g)
            carry = grads_of(start.input) if i > 0 else None
            self._stepper.after_backward(shard, batch)
        finally:
            for store in (self._inputs, self._outputs, self._rng_at):
                store.pop(i, None)
        return carry

    # -- evaluation -------------------------------------------------------------------

    def eval(self, shard: ShardRuntime, device: torch.device, x: Any, batch: int) -> Any:
        """Eval batch ``batch``'s forward through ``shard`` (not the last), without
        gradients; returns the shard's output."""
        shard.module.eval()
        try:
            with self._stream(shard, device), torch.no_grad(), self._autocast(device):
                return self._checks.call(shard, x, batch, train=False)
        finally:
            shard.module.train()

    def eval_loss(
        self,
        shard: ShardRuntime,
        device: torch.device,
        x: Any,
        target: Any,
        batch: int,
        metrics: MetricTotals,
    ) -> float:
        """Eval batch ``batch`` through the last shard: returns its loss, and adds its
        output to ``metrics``."""
        shard.module.eval()
        try:
            with self._stream(shard, device), torch.no_grad(), self._autocast(device):
                out = self._checks.call(shard, x, batch, train=False)
                target = to_device(target, device)
                loss = self._checks.loss(out, target, batch, train=False)
                value = float(loss.item())
                if metrics.metrics:
                    metrics.add(out, target, self.name, self._checks.where(batch, False))
                return value
        finally:
            shard.module.train()

    # -- the task's RNG stream and precision -----------------------------------------

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
        stream = self._stream_state
        with rng.task_stream(
            stream, device, self._seed, replay=replay, cpu=cpu, cuda=cuda
        ) as scope:
            yield scope.entry
        if replay is None:
            if cpu and shard.cpu_rng is None:
                shard.cpu_rng = scope.drew_cpu
            if cuda and shard.cuda_rng is None:
                shard.cuda_rng = scope.drew_cuda

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self._autocast_dtype is None:
            return _NULL
        # The loops' code (a th.shard loop enters its user's autocast the same way).
        return amp.entered(amp.Autocast(((device.type, self._autocast_dtype),)))
