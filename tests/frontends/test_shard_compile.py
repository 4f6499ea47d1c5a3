"""th.shard and torch.compile: each shard's forward compiled with the user's settings.

Every reference is the same loop on a ``copy.deepcopy`` of the model, compiled the same
way without ``th.shard`` (compiled vs compiled: a backend need not round as eager does).
The exact tests use :class:`Counting`, a backend that runs dynamo's graphs as
``aot_eager`` does and counts the graphs compiled and their calls, so each test also
shows the shards ran compiled code (a run of the shards uncompiled gives the same numbers
under aot_eager, and no calls). The float64 model has Dropout (the compiled code draws
from the loop's stream, replayed by the recompute) and BatchNorm (buffers written in the
compiled forward).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import batches, mlp
from tune_hydra.exceptions import AlreadyShardedError, UnsupportedCompileError

torch_dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.backends.debugging import aot_eager  # noqa: E402
from torch._dynamo.eval_frame import OptimizedModule  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from tests.conftest import assert_same  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> Iterator[None]:
    """Every test here on one torch thread (see the shared fixture), on dynamo's empty
    caches: the plain references' ``torch.compile(nn.Sequential)`` graphs all live on
    one code object, at most 8 of them in a process, after which plain runs eagerly."""
    torch_dynamo.reset()
    yield
    torch_dynamo.reset()


class Counting:
    """A ``torch.compile`` backend: ``aot_eager``, counting graphs and calls."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        compiled = aot_eager(gm, example_inputs)

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run


@pytest.fixture(params=["copying", "in place"])
def engine(request: pytest.FixtureRequest) -> Iterator[th.Engine]:
    """2 emulated copying devices (the shards' tensors swapped in and out, recomputing in
    backward), or one CPU device in place (keeping each forward's graph)."""
    if request.param == "copying":
        eng = th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=3)
    else:
        eng = th.Engine(devices=["cpu"], max_layers_per_shard=3)
    yield eng
    eng.close()


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any]) -> list[float]:
    """The user's loop: one epoch (clipping the gradients it reads through the model's
    ``parameters()``), then an evaluation under no_grad."""
    history = []
    model.train()
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        history.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        history.append(loss.item())
    model.eval()
    with torch.no_grad():
        history.append(F.cross_entropy(model(data[0][0]), data[0][1]).item())
    return history


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def shards_of(model: nn.Module) -> list[Any]:
    inner = model._orig_mod if isinstance(model, OptimizedModule) else model
    return inner.__dict__["_th_shard"].loop.shards  # type: ignore[no-any-return]


def test_shard_of_compiled_model_exact(engine: th.Engine) -> None:
    # model = torch.compile(model); th.shard(model, opt): the user's OptimizedModule,
    # its original module sharded, each shard compiled with that torch.compile's backend.
    data = batches(4)
    model, want_backend, got_backend = mlp(), Counting(), Counting()
    ref = torch.compile(copy.deepcopy(model), backend=want_backend)
    ref_opt = adam(ref)
    compiled = torch.compile(model, backend=got_backend)
    sharded, opt = th.shard(compiled, adam(compiled), engine=engine)
    assert sharded is compiled and isinstance(sharded, OptimizedModule)
    assert sharded._orig_mod is model
    counters.clear()
    for _ in range(2):  # the second epoch: nothing recompiles (tensors swapped or not)
        torch.manual_seed(3)
        got = train(sharded, opt, data)
        torch.manual_seed(3)
        want = train(ref, ref_opt, data)
        assert got == want
        frames = counters["frames"]["ok"]
        if _ == 0:
            first = frames
    assert frames == first > 0
    assert engine.tasks() and len(shards_of(sharded)) >= 3
    # plain PyTorch's keys for the object the user holds (the _orig_mod. prefix)
    assert_same(sharded.state_dict(), ref.state_dict())
    assert_same(opt.state_dict()["state"][0], ref_opt.state_dict()["state"][0])
    # Every op ran compiled code: a forward op per shard and batch, its recompute on
    # copying devices, an evaluation op per shard.
    n = len(shards_of(sharded))
    per_batch = 2 if engine.copy_on_cpu else 1
    assert got_backend.calls == 2 * n * (len(data) * per_batch + 1)
    assert got_backend.graphs <= first


@pytest.mark.parametrize("form", ["torch.compile after", "module.compile"])
def test_compile_of_sharded_model_exact(form: str, engine: th.Engine) -> None:
    # th.shard first, then torch.compile(model) (an OptimizedModule the first call adopts)
    # or model.compile() in place, after the cut: each shard compiled from then on.
    data = batches(4)
    model, want_backend, got_backend = mlp(), Counting(), Counting()
    ref = copy.deepcopy(model)
    ref_opt = adam(ref)
    sharded, opt = th.shard(model, adam(model), engine=engine)
    torch.manual_seed(3)
    first = train(sharded, opt, data[:1])  # the cut, eager
    torch.manual_seed(3)
    assert first == train(ref, ref_opt, data[:1])
    if form == "module.compile":
        ref.compile(backend=want_backend)
        sharded.compile(backend=got_backend)
        call = sharded
    else:
        ref = torch.compile(ref, backend=want_backend)
        call = torch.compile(sharded, backend=got_backend)
    torch.manual_seed(4)
    got = train(call, opt, data)
    torch.manual_seed(4)
    want = train(ref, ref_opt, data)
    assert got == want
    assert_same(call.state_dict(), ref.state_dict())
    per_batch = 2 if engine.copy_on_cpu else 1  # a forward op (and its recompute)
    assert got_backend.calls == len(shards_of(call)) * (len(data) * per_batch + 1)
    # (nn.Sequential.compile() compiles nothing in plain PyTorch: dynamo skips torch.nn's
    # frames; a sharded model's shards are compiled whatever the model's class.)
    assert want_backend.calls == (0 if form == "module.compile" else len(data) + 1)


def test_compile_with_inductor_exact_to_compiled_plain() -> None:
    # The default backend (inductor, C++ on the CPU), float32, dropout: bit-equal to the
    # plain compiled model here (one graph per shard vs one: inductor fuses pointwise ops
    # within a graph, which rounds as across graphs; its seeds come from the loop's stream).
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    data = batches(2, dtype=torch.float32)
    ref = torch.compile(copy.deepcopy(model))
    ref_opt = adam(ref)
    torch.manual_seed(5)
    want = train(ref, ref_opt, data)
    plain_frames = counters["frames"]["ok"]
    with th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2) as eng:
        sharded, opt = th.shard(torch.compile(model), adam(model), engine=eng)
        torch.manual_seed(5)
        got = train(sharded, opt, data)
        assert got == want
        assert_same(sharded.state_dict(), ref.state_dict())
        assert th.shard_count(sharded) == 3
        assert counters["frames"]["ok"] - plain_frames >= 3  # each shard's forward compiled


def test_compiled_code_around_a_sharded_model_raises(engine: th.Engine) -> None:
    model = mlp()
    sharded, _ = th.shard(model, adam(model), engine=engine)
    x = batches(1)[0][0]

    def step(x: torch.Tensor) -> torch.Tensor:
        return sharded(x).square().mean()

    with pytest.raises(UnsupportedCompileError, match="Compile the model itself"):
        torch.compile(step, backend="eager")(x)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = sharded

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * 2

    with pytest.raises(UnsupportedCompileError, match=r"th.shard\(torch.compile"):
        torch.compile(Outer(), backend="eager")(x)
    # model.compile() before th.shard: its compiled call would trace the engine.
    other = mlp()
    other.compile(backend="eager")
    with pytest.raises(UnsupportedCompileError, match=r"before th\.shard"):
        th.shard(other, adam(other), engine=engine)
    with pytest.raises(AlreadyShardedError):
        th.shard(torch.compile(sharded), engine=engine)


def test_unshard_and_copies_give_plain_compiled_modules(engine: th.Engine) -> None:
    data = batches(2)
    model, backend = mlp(), Counting()
    compiled, opt = th.shard(torch.compile(model, backend=backend), adam(model), engine=engine)
    train(compiled, opt, data)
    copied = copy.deepcopy(compiled)
    assert type(copied) is OptimizedModule and type(copied._orig_mod) is nn.Sequential
    assert_same(copied.state_dict(), compiled.state_dict())
    # load_state_dict of the keys plain gives (_orig_mod.), into the shards' state
    other = torch.compile(mlp(seed=1), backend="eager")
    compiled.load_state_dict(other.state_dict())
    assert_same(compiled.state_dict(), other.state_dict())
    compiled.eval()
    other.eval()
    with torch.no_grad():
        assert torch.equal(compiled(data[0][0]), other(data[0][0]))
    assert th.unshard(compiled) is compiled
    assert type(compiled) is OptimizedModule and type(model) is nn.Sequential
    assert not engine.tasks()
    before = backend.calls
    train(compiled, opt, data)  # plain compiled again: one graph call a forward
    assert backend.calls == before + len(data) + 1


def test_hugging_face_blocks_compiled_exact() -> None:
    # GPT-2: each block compiled (one graph per mode for both: they share a signature),
    # the embed and head stages eager; bit-equal to the plain eager loop in float64.
    from tests.frontends.test_shard import gpt2, lm_data

    data = lm_data(3)
    model, backend = gpt2(), Counting()
    ref = copy.deepcopy(model)
    ref_opt = adam(ref)
    with th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2) as eng:
        sharded, opt = th.shard(torch.compile(model, backend=backend), adam(model), engine=eng)
        got, want = [], []
        for m, o, out in ((sharded, opt, got), (ref, ref_opt, want)):
            torch.manual_seed(1)  # GPT-2's dropout
            for batch in data:
                o.zero_grad()
                loss = m(**batch).loss
                loss.backward()
                o.step()
                out.append(loss.item())
        assert got == want
        assert_same(sharded._orig_mod.state_dict(), ref.state_dict())
        blocks = len(model.transformer.h)
        assert backend.calls == len(data) * blocks * 2  # a forward op and its recompute
        assert backend.graphs == 2 * blocks  # each block its own (its layer_idx is guarded)
        assert all(b.__dict__.get("_compiled_call_impl") for b in model.transformer.h)
        th.unshard(sharded)  # the user's blocks are called as before th.shard again
        assert all(b.__dict__.get("_compiled_call_impl") is None for b in model.transformer.h)


def test_compiled_sharded_model_under_a_private_stream(engine: th.Engine) -> None:
    # th.optimize runs each objective on a private generator (a dispatch mode): dynamo
    # must still compile there (torch skips, for good, code it meets under such a mode).
    from tune_hydra.engine.registration.factory import private_rng

    data = batches(3)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    model = nn.Sequential(*layers).double()
    ref, want_backend, got_backend = copy.deepcopy(model), Counting(), Counting()
    with private_rng(0):
        ref_c = torch.compile(ref, backend=want_backend)
        want = train(ref_c, adam(ref), data)
        sharded, opt = th.shard(model, adam(model), engine=engine)
        got = train(torch.compile(sharded, backend=got_backend), opt, data)
    assert got == want
    assert want_backend.calls == len(data) + 1
    per_batch = 2 if engine.copy_on_cpu else 1
    assert got_backend.calls == len(shards_of(sharded)) * (len(data) * per_batch + 1)


def test_loops_in_threads_compiling_at_once_exact(engine: th.Engine) -> None:
    # Three loops in threads (th.optimize's n_jobs: each on a private stream), each
    # compiling its shards on the engine's device threads while the others run: torch's
    # compile-time flags are process-wide (an Adam step elsewhere rounds otherwise, a
    # compiled call elsewhere raises), so a call that compiles runs alone. Each equals
    # its loop run alone in a fresh process (the global stream seeded as the private one).
    from tune_hydra.engine.registration.factory import private_rng

    data = batches(3)
    models = [mlp(seed=i) for i in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    got: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with private_rng(i):
                model, opt = th.shard(
                    torch.compile(models[i], backend="aot_eager"), adam(models[i]), engine=engine
                )
                got[i] = train(model, opt, data)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, ref in enumerate(refs):
        torch.manual_seed(i)
        assert got[i] == train(torch.compile(ref, backend="aot_eager"), adam(ref), data), i
