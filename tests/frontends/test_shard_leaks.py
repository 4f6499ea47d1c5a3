"""A ``th.shard`` loop leaves its engine, and its model is freed, once the user's
references are gone (issue #29 item 7), however the loop ended:

- failed by the user's code inside an op (its forward, a backward, a deferred step
  raising): the user sees the error, with the traceback of their code;
- failed by the engine (an op it could not run: injected here at the store's
  ``begin_op``, as a disk read or a shared-frozen-tensor check raises there, and a real
  :class:`~tune_hydra.exceptions.FrozenTensorModifiedError`): what the engine keeps of
  the error (a later call raises it again) holds no frames, so neither the user's model
  nor the frames the error's delivery added to its traceback stay alive;
- a Hugging Face model (tiny GPT-2 and Llama from their configs) whose cut references it
  weakly;
- a dropped model's removal, done by one long-lived thread (no thread started from the
  garbage collector's finalizer, which could fail).

Each case checks ``engine.tasks()`` (after ``gc.collect()``, with a bounded wait: removal
happens on a thread), a weak reference to each model, and over 20 trials after 3 of
warm-up the process's RSS (a generous bound) and that no task stays.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tune_hydra as th
from tune_hydra.core.ops import OpKind
from tune_hydra.exceptions import FrozenTensorModifiedError, TaskFailedError, TuneHydraError


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


# -- helpers ----------------------------------------------------------------------------


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def holders(refs: list[weakref.ref[nn.Module]]) -> str:
    """The referrers of the models still alive (types, and code of frames)."""
    out = []
    for ref in refs:
        model = ref()
        if model is None:
            continue
        kinds = []
        for r in gc.get_referrers(model):
            code = getattr(r, "f_code", None)
            kinds.append(f"frame {code.co_name}" if code is not None else type(r).__name__)
        out.append(f"{type(model).__name__} held by {kinds}")
        del model
    return "; ".join(out)


def assert_gone(
    engine: th.Engine, refs: list[weakref.ref[nn.Module]], keep: list[str] | None = None
) -> None:
    """Wait (bounded) until only ``keep`` tasks are left and every model of ``refs`` is
    garbage-collected."""
    keep = keep or []
    for _ in range(200):
        gc.collect()
        if engine.tasks() == keep and all(r() is None for r in refs):
            return
        time.sleep(0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        held = holders(refs)
    assert engine.tasks() == keep, held
    assert all(r() is None for r in refs), held


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the user's backward failed")


class Faulty(nn.Module):
    """Raises in its forward or in its backward once ``armed``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and self.where == "forward":
            raise RuntimeError("the user's forward failed")
        if self.armed and self.where == "backward":
            return _RaiseInBackward.apply(x)
        return x


def mlp(where: str = "none", seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Faulty(where), nn.Linear(16, 4))


def one_batch(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def fail_in_users_code(engine: th.Engine, where: str) -> weakref.ref[nn.Module]:
    """A loop trains a batch, then its forward, its backward or its (deferred) step
    raises inside an op; the caller's references end with this function."""
    model = mlp(where)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = th.shard(model, opt, engine=engine)
    x = torch.randn(4, 8)
    one_batch(model, opt, x)
    faulty = model[2]
    faulty.armed = True
    if where == "step":  # a bad hyperparameter: the step applied at the next op raises
        opt.param_groups[0]["lr"] = "not a number"
    with pytest.raises((RuntimeError, TypeError)) as info:
        for _ in range(2):
            one_batch(model, opt, x)
    text = "".join(traceback.format_exception(info.value))
    assert "fail_in_users_code" in text  # the user's frames are in what they see
    # Failed by the user: the loop stays until its model is dropped.
    assert model.__dict__["_th_shard"].loop.name in engine.tasks()
    return weakref.ref(model)


Arm = Callable[[nn.Module, OpKind, type[BaseException]], None]


@pytest.fixture
def fail_at() -> Iterator[Arm]:
    """``fail_at(model, kind, error)``: the engine fails the model's next op of ``kind``
    with a new ``error("the engine failed it")`` (raised where the worker begins the op
    on the shard's store; a new one each time, as the engine's own errors are)."""

    def arm(model: nn.Module, kind: OpKind, error: type[BaseException]) -> None:
        loop = model.__dict__["_th_shard"].loop
        for shard in loop.shards:
            store = shard.store
            begin = type(store).begin_op.__get__(store)

            def begin_op(k: OpKind, begin: Any = begin) -> None:
                if k is kind:
                    raise error("the engine failed it")
                begin(k)

            store.begin_op = begin_op

    yield arm


def fail_in_engine(
    engine: th.Engine,
    fail_at: Arm,
    kind: OpKind,
    error: type[BaseException],
) -> weakref.ref[nn.Module]:
    """A loop trains a batch, then the engine fails its forward, backward or step op; a
    later call raises the loop's error again."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = th.shard(model, opt, engine=engine)
    x = torch.randn(4, 8)
    one_batch(model, opt, x)
    fail_at(model, kind, error)
    with pytest.raises(TuneHydraError) as info:
        one_batch(model, opt, x)
        if kind is OpKind.STEP:  # the step ops of a sync: reading the parameters
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    first = info.value
    text = "".join(traceback.format_exception(first))
    assert "fail_in_engine" in text and "the engine failed it" in text
    if not issubclass(error, TuneHydraError):
        assert isinstance(first, TaskFailedError) and isinstance(first.__cause__, error)
    # Failed by the engine: every later op raises its error again.
    with pytest.raises(TuneHydraError, match="the engine failed it") as again:
        model(x)
    assert "fail_in_engine" in "".join(traceback.format_exception(again.value))
    return weakref.ref(model)


# -- failed loops -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["forward", "backward", "step"])
def test_loop_failed_by_the_users_code_leaves(engine: th.Engine, where: str) -> None:
    ref = fail_in_users_code(engine, where)
    assert_gone(engine, [ref])


@pytest.mark.parametrize("kind", [OpKind.FORWARD, OpKind.BACKWARD, OpKind.STEP])
@pytest.mark.parametrize("error", ["engine", "other"])
def test_loop_failed_by_the_engine_leaves(
    engine: th.Engine,
    fail_at: Arm,
    kind: OpKind,
    error: str,
) -> None:
    # Before: the error the engine keeps for the loop's later calls was the one raised
    # in the user's thread, whose traceback then held the user's frames (and the model):
    # the loop never left.
    ref = fail_in_engine(engine, fail_at, kind, TuneHydraError if error == "engine" else OSError)
    assert_gone(engine, [ref])


def test_loop_writing_a_shared_frozen_tensor_leaves(engine: th.Engine) -> None:
    # A real engine failure: two loops share a frozen first layer (equal weights); one
    # writes it in its forward and fails alone with FrozenTensorModifiedError; once
    # dropped it leaves, the other trains on.
    def frozen_mlp() -> nn.Sequential:
        model = mlp()
        model[0].requires_grad_(False)
        return model

    good = frozen_mlp()
    good, good_opt = th.shard(good, torch.optim.SGD(good.parameters(), lr=0.1), engine=engine)
    x = torch.randn(4, 8)
    one_batch(good, good_opt, x)

    def bad_loop() -> weakref.ref[nn.Module]:
        model = frozen_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = th.shard(model, opt, engine=engine)
        one_batch(model, opt, x)

        def write(module: nn.Module, args: Any) -> None:
            assert isinstance(module, nn.Linear)
            with torch.no_grad():
                module.weight.mul_(0.5)

        model[0].register_forward_pre_hook(write)
        with pytest.raises(FrozenTensorModifiedError):
            one_batch(model, opt, x)
        return weakref.ref(model)

    ref = bad_loop()
    keep = [good.__dict__["_th_shard"].loop.name]
    assert_gone(engine, [ref], keep=keep)
    one_batch(good, good_opt, x)


def test_failing_trials_leave_no_task_and_no_memory(engine: th.Engine, fail_at: Arm) -> None:
    # 3 trials of warm-up, then 20 more: each failing one way or another leaves the
    # engine and frees its model; the process does not grow.
    ways: list[Callable[[], weakref.ref[nn.Module]]] = [
        lambda: fail_in_users_code(engine, "forward"),
        lambda: fail_in_users_code(engine, "backward"),
        lambda: fail_in_users_code(engine, "step"),
        lambda: fail_in_engine(engine, fail_at, OpKind.FORWARD, OSError),
        lambda: fail_in_engine(engine, fail_at, OpKind.BACKWARD, TuneHydraError),
    ]
    rss = 0.0
    for i in range(23):
        if i == 3:
            gc.collect()
            rss = rss_mib()
        ref = ways[i % len(ways)]()
        assert_gone(engine, [ref])
    gc.collect()
    assert rss_mib() - rss < 20, (rss, rss_mib())


# -- Hugging Face models ----------------------------------------------------------------


def hf_model(arch: str, seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=16,
            n_head=2,
            vocab_size=32,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


def hf_trial(engine: th.Engine, arch: str, seed: int = 0) -> weakref.ref[nn.Module]:
    model = hf_model(arch, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = th.shard(model, opt, engine=engine)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):
        ids = torch.randint(0, 32, (2, 8), generator=g)
        opt.zero_grad()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert len(engine.tasks()) == 1
    return weakref.ref(model)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_loop_leaves_when_its_model_is_dropped(engine: th.Engine, arch: str) -> None:
    # Before: the cut's stages held the model: its loop never left.
    ref = hf_trial(engine, arch)
    assert_gone(engine, [ref])


def test_hf_trials_leave_no_task_and_no_memory(engine: th.Engine) -> None:
    rss = 0.0
    for i in range(23):
        if i == 3:
            gc.collect()
            rss = rss_mib()
        ref = hf_trial(engine, "gpt2", seed=i)
        assert_gone(engine, [ref])
    gc.collect()
    assert rss_mib() - rss < 20, (rss, rss_mib())


def test_study_optimize_failing_and_hf_trials_leave(engine: th.Engine, fail_at: Arm) -> None:
    # Optuna threads: Hugging Face trials complete, others fail in the user's code or in
    # the engine; no loop stays and every model is freed.
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    refs: list[weakref.ref[nn.Module]] = []
    lock = threading.Lock()

    def objective(trial: Any) -> float:
        kind = trial.number % 3
        if kind == 0:
            ref = hf_trial_in(engine, trial.number)
        elif kind == 1:
            ref = fail_in_users_code(engine, "backward")
        else:
            ref = fail_in_engine(engine, fail_at, OpKind.FORWARD, TuneHydraError)
        with lock:
            refs.append(ref)
        if kind:
            raise RuntimeError("this trial failed")
        return 0.0

    s = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    s.optimize(objective, n_trials=6, n_jobs=2, catch=(RuntimeError,))
    states = sorted(t.state.name for t in s.trials)
    assert states == ["COMPLETE"] * 2 + ["FAIL"] * 4
    assert len(refs) == 6
    assert_gone(engine, refs)


def hf_trial_in(engine: th.Engine, seed: int) -> weakref.ref[nn.Module]:
    """An HF trial in a thread (the counts of other threads' loops aside)."""
    model = hf_model("gpt2", seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = th.shard(model, opt, engine=engine)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return weakref.ref(model)


# -- the removal ---------------------------------------------------------------------------


def test_dropped_model_leaves_even_if_no_thread_can_start(
    engine: th.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The finalizer runs inside the garbage collector (any thread, any moment): it only
    # queues the removal for one thread started with th.shard. Before, it started a
    # thread of its own, and a failing start (no thread left) left the loop on the
    # engine for good.
    model = th.shard(mlp(), engine=engine)
    model(torch.randn(4, 8)).sum().backward()
    ref = weakref.ref(model)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", refuse)
        del model
        gc.collect()
    assert ref() is None
    assert_gone(engine, [ref])


# -- a loop leaves by identity, never by its name -------------------------------------------


def test_a_loop_that_left_never_takes_the_next_owner_of_its_name_along(
    engine: th.Engine,
) -> None:
    """A trial's run unshards its model (a class trainable's cleanup), its retried copy
    shards a new model under the same name, then the first run's scope closes: the name's
    new owner stays (before: the scope removed the name again, and the new copy's next
    op failed with "no task named ...")."""
    from tune_hydra.frontends.shard import engine_scope

    def loop() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model, opt = th.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), name="t")
        nn.functional.mse_loss(model(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
        opt.step()
        return model, opt

    with engine_scope(engine) as first:
        old, _ = loop()
        th.unshard(old)
    with engine_scope(engine) as second:
        new, opt = loop()
        first.close()
        assert engine.tasks() == ["t"]
        nn.functional.mse_loss(new(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
        opt.step()
        second.close()
    assert engine.tasks() == []
