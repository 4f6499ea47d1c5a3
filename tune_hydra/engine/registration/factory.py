"""Calling a user's task factory inside the engine's process, safely.

Front ends (the Ray engine actor today) build each trial's :class:`ModelTask` by calling
the user's factory in the engine's process, next to the device threads that are training
other trials. Two things make that unsafe if done naively:

* **Random numbers.** The factory seeds and draws from torch's *global* CPU generator
  (``torch.manual_seed``, weight init, ``torch.randn`` data, a shuffling ``DataLoader``),
  and so do the engine's threads (each task's stream is installed there around its ops).
  Holding the engine's RNG lock while the factory runs kept both exact, but froze every
  other trial for as long as the factory took (a dataset download: the whole node).
  Instead the factory runs in its own thread on a **private generator**:
  :func:`private_rng` routes every CPU random op of that thread (a thread-local torch
  dispatch mode adds ``generator=`` to ops called without one) and that thread's calls of
  ``torch.manual_seed`` / ``get_rng_state`` / ``set_rng_state`` / ``seed`` /
  ``initial_seed`` to it. The factory draws exactly the numbers it would draw alone in a
  fresh process, whatever the other threads do, and no lock is held.
* **Time.** A factory that never returns must not hang its trial forever:
  :func:`call_factory` waits at most ``timeout_s`` and then fails with
  :class:`~tune_hydra.exceptions.TaskFactoryTimeoutError`. Python cannot kill a thread:
  the abandoned call keeps running in a daemon thread (on its private generator, so it
  cannot disturb the others) and its result, if it ever comes, is dropped.

Limits: draws on a GPU inside the factory use that GPU's own generator (the engine's
device threads use it too; build on the CPU, which is what the engine expects anyway), and
code that passes ``torch.default_generator`` explicitly bypasses the private generator.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tune_hydra.engine.runtime.rng import CPU_RNG_LOCK
from tune_hydra.exceptions import TaskFactoryError, TaskFactoryTimeoutError

logger = logging.getLogger(__name__)

_LOCAL = threading.local()  # .gen: the private generator of a factory thread
_PATCH_LOCK = threading.Lock()
# torch's module-level RNG functions, routed to the private generator in factory threads.
_RNG_FUNCTIONS = ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state")


def _private() -> torch.Generator | None:
    return getattr(_LOCAL, "gen", None)


def _routed(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gen = _private()
        if gen is None:
            # Under the engine's RNG lock: an op installs its task's stream into the
            # global generator under that lock, and a seed set by another thread in the
            # middle of it would be lost (restored over) and change that task's draws.
            with CPU_RNG_LOCK:
                return original(*args, **kwargs)
        if name == "manual_seed":
            return gen.manual_seed(int(args[0] if args else kwargs["seed"]))
        if name == "seed":
            return gen.seed()
        if name == "initial_seed":
            return gen.initial_seed()
        if name == "get_rng_state":
            return gen.get_state()
        gen.set_state(args[0] if args else kwargs["new_state"])
        return None

    wrapper.__tune_hydra_original__ = original  # type: ignore[attr-defined]
    return wrapper


def patch_rng_functions() -> None:
    """Route torch's RNG functions through :func:`_routed` (outside factory threads the
    wrappers do what they wrap, under the engine's RNG lock). Checked on every use: each module
    attribute is wrapped on its own, since other code may have replaced one of them
    (importing ``torch._dynamo`` re-wraps ``torch.manual_seed``) before or after us."""
    with _PATCH_LOCK:
        for name in _RNG_FUNCTIONS:
            for module in (torch, torch.random):
                current = getattr(module, name)
                if getattr(current, "__tune_hydra_original__", None) is None:
                    setattr(module, name, _routed(name, current))


_UNSEEN = object()  # an op not looked up yet (None: it has no overload taking a generator)


class _PrivateGenerator(TorchDispatchMode):
    """Adds ``generator=gen`` to the CPU random ops of the thread it is active in.

    Ops called without a generator are redirected to their overload that takes one
    (``aten.randn.default`` -> ``aten.randn.generator``); ops on other devices (a GPU,
    ``meta``) pass through unchanged. :attr:`drew` tells whether an op was redirected.
    """

    # op -> its overload taking a generator (None: none); the same for every instance.
    _targets: dict[Any, Any] = {}

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.gen = gen
        self.drew = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # True: torch.compile compiles under this mode (off while compiling, on while the
        # compiled code runs, whose random ops, inductor's seeds included, it redirects).
        # False (torch's default) makes dynamo skip every frame it meets under the mode and
        # never compile that code again, without a word: a compiled model, or a loop's
        # compiled shard, would run eagerly for good after one op under a private stream.
        return True

    @classmethod
    def _target(cls, func: Any) -> Any:
        try:
            return cls._targets[func]
        except KeyError:
            pass
        names = [a.name for a in func._schema.arguments]
        target = None
        if "generator" in names:
            target = func
        else:
            packet = func.overloadpacket
            for overload in packet.overloads():
                candidate = getattr(packet, overload)
                cand = [a.name for a in candidate._schema.arguments]
                if "generator" in cand and [n for n in cand if n != "generator"] == names:
                    target = candidate
                    break
        cls._targets[func] = target
        return target

    @staticmethod
    def _on_cpu(args: Any, kwargs: dict[str, Any]) -> bool:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        return all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # Every aten op of the block passes here: the ops that cannot draw (nearly all)
        # go straight on (a forward of a GPT-2 block is ~250 ops; this path is its cost).
        target = self._targets.get(func, _UNSEEN)
        if target is _UNSEEN:
            target = self._target(func)
        if target is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = dict(kwargs or {})
        if kwargs.get("generator") is None and self._on_cpu(args, kwargs):
            kwargs["generator"] = self.gen
            self.drew = True
            return target(*args, **kwargs)
        return func(*args, **kwargs)


def thread_generator() -> torch.Generator | None:
    """The private generator the calling thread draws from (inside :func:`private_rng` or
    :func:`use_generator`), or ``None`` where it draws from torch's global one."""
    return _private()


@contextmanager
def use_generator(gen: torch.Generator) -> Iterator[_PrivateGenerator]:
    """Run a block of the current thread on ``gen``: its CPU random ops (those called
    without a generator) draw from ``gen``, and its ``torch.manual_seed`` /
    ``get_rng_state`` / ``set_rng_state`` / ``seed`` / ``initial_seed`` calls act on it.
    torch's global generator is not touched. Yields the dispatch mode, whose ``drew``
    says afterwards whether the block drew from ``gen``.

    The mechanism of :func:`private_rng`, with a generator the caller keeps (a loop's
    ops run on their loop's stream so, on the engine's device threads).
    """
    patch_rng_functions()
    outer = _private()
    _LOCAL.gen = gen
    try:
        with _PrivateGenerator(gen) as mode:
            yield mode
    finally:
        _LOCAL.gen = outer


@contextmanager
def private_rng(seed: int | None = None) -> Iterator[torch.Generator]:
    """Run a block of the current thread on a private CPU generator.

    Inside, every CPU random op of this thread and its ``torch.manual_seed`` /
    ``get_rng_state`` / ``set_rng_state`` / ``seed`` / ``initial_seed`` calls use the
    private generator; other threads keep using (and changing) the global one without
    affecting this block. The generator starts where a fresh process's would: seeded with
    ``seed``, or randomly (torch seeds a new process randomly) when ``seed`` is None.

    A front end wraps a user's whole function in it when it runs the function in a thread
    (``th.optimize``'s objectives, through :func:`call_factory`; the Ray front end's
    function trainables): the ``th.shard`` loops made inside draw their ops' random
    numbers from this generator too, on the engine's device threads, interleaved with the
    function's own draws as in plain PyTorch (see :mod:`tune_hydra.engine.runtime.loop`).

    Example:
        >>> import torch
        >>> from tune_hydra.engine.registration.factory import private_rng
        >>> with private_rng():
        ...     _ = torch.manual_seed(0)
        ...     a = torch.randn(3)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(a, torch.randn(3))
        True
    """
    # torch's intra-op thread count applied to this thread now (a new thread gets it only
    # at its first parallel_for; an MKL vector op before that, such as Adam's sqrt, runs
    # an OpenMP team of one spinning thread per core).
    torch.set_num_threads(torch.get_num_threads())
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    with use_generator(gen):
        yield gen


def start_factory(
    factory: Callable[[Any], Any], argument: Any, *, what: str, seed: int | None = None
) -> concurrent.futures.Future[Any]:
    """Start ``factory(argument)`` in its own daemon thread on a private generator (see the
    module docstring); the future gets its result, or a :class:`TaskFactoryError` holding
    its traceback. A caller that stops waiting may cancel the future: the result of a call
    that ends later is then dropped (and logged)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def target() -> None:
        try:
            with private_rng(seed):
                result = factory(argument)
        except BaseException as err:  # reported to the caller, whatever it is
            outcome: Any = TaskFactoryError(
                f"the task factory raised for {what}; fix make_task, the other trials go "
                f"on. Factory traceback:\n{traceback.format_exc()}"
            )
            # In-process callers (th.plan's note) read the cause; pickling drops it, so
            # an unpicklable user exception never travels. Without its traceback, which
            # would keep the factory's frames (a half-built model) alive with the error.
            outcome.__cause__ = _without_tracebacks(err)
        else:
            outcome = None
        try:
            if outcome is None:
                future.set_result(result)
            else:
                future.set_exception(outcome)
        except concurrent.futures.InvalidStateError:  # cancelled: nobody waits any more
            logger.warning(
                "tune_hydra: the task factory for %s ended after its caller gave up "
                "waiting; its result was dropped",
                what,
            )

    threading.Thread(target=target, name="hydra-factory", daemon=True).start()
    return future


def _without_tracebacks(err: BaseException) -> BaseException:
    """``err`` with the tracebacks of it and of its causes and contexts dropped."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]
    return err


def call_factory(
    factory: Callable[[Any], Any],
    argument: Any,
    *,
    what: str,
    seed: int | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Call ``factory(argument)`` in its own thread on a private generator (see the
    module docstring), waiting at most ``timeout_s`` seconds.

    Args:
        factory: the user's task factory.
        argument: what it is called with (a Tune config, an Optuna trial ...).
        what: names the call in errors, e.g. ``"trial 3f2a (config {...})"``.
        seed: the private generator's seed (None: random, like a fresh process).
        timeout_s: None waits forever.

    Returns:
        What the factory returned (not checked here).

    Raises:
        TaskFactoryError: the factory raised; the message holds its traceback.
        TaskFactoryTimeoutError: it did not return within ``timeout_s``.

    Example:
        >>> import torch
        >>> from tune_hydra.engine.registration.factory import call_factory
        >>> def make(config):
        ...     torch.manual_seed(config["seed"])
        ...     return torch.randn(2)
        >>> a = call_factory(make, {"seed": 1}, what="an example", timeout_s=60)
        >>> torch.equal(a, torch.manual_seed(1) and torch.randn(2))
        True
    """
    future = start_factory(factory, argument, what=what, seed=seed)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TaskFactoryTimeoutError(what, float(timeout_s or 0.0)) from None


__all__ = [
    "call_factory",
    "private_rng",
    "start_factory",
    "thread_generator",
    "use_generator",
]
