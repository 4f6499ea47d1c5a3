"""th.shard: the user's own loop, with and without the th.shard line, is bit-equal (float64).

Every reference is the same loop run on a deepcopy of the model without ``th.shard``; the
sharded runs use 2 emulated copying devices (each shard's state copied in and out, as on a
GPU) unless said otherwise. torch runs on one intra-op thread in this module: the engine
gives each of its 2 emulated devices half of the threads, and a reduction (LayerNorm's
weight gradient) rounds by how it is split.
"""

from __future__ import annotations

import copy
import gc
import io
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tests.conftest import assert_same, assert_same_optimizer, batches, mlp
from tune_hydra.exceptions import (
    AlreadyShardedError,
    EngineConfiguredError,
    ModelOnDeviceError,
    OptimizerMismatchError,
    ShardClosedError,
    TuneHydraError,
    UnsupportedCallError,
)
from tune_hydra.frontends import shard as shard_mod


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


# -- the user's code: models and loops, as they would write them ---------------------------


class ConvNet(nn.Module):
    """Ray Tune's MNIST example's model."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, kernel_size=3)
        self.fc = nn.Linear(192, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 3))
        x = x.view(-1, 192)
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


def convnet() -> nn.Module:
    return ConvNet().double()


def conv_data(n: int = 4, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(4, 1, 28, 28, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (4,), generator=g),
        )
        for _ in range(n)
    ]


def gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=32,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(torch.float64)


def lm_data(n: int = 4, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 32, (2, 8), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.nll_loss(out, y) if isinstance(model, ConvNet) else F.cross_entropy(out, y)


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch)
    return out.loss


def accuracy(model: nn.Module, data: list[Any]) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in data:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    return correct / total


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[Any],
    loss_of: Callable[[nn.Module, Any], torch.Tensor],
    *,
    epochs: int = 2,
    clip: float | None = None,
    accumulate: int = 1,
    scheduler: Any = None,
    evaluate: Callable[[nn.Module], float] | None = None,
) -> list[Any]:
    """A user's loop: zero_grad, forward, backward (accumulate backward() per step),
    clip_grad_norm_, step, the scheduler; an evaluation after each epoch."""
    history: list[Any] = []
    for _ in range(epochs):
        model.train()
        for i, batch in enumerate(data):
            if i % accumulate == 0:
                optimizer.zero_grad()
            loss = loss_of(model, batch)
            (loss / accumulate).backward()
            history.append(loss.item())
            if (i + 1) % accumulate == 0:
                if clip is not None:
                    history.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
        if evaluate is not None:
            history.append(evaluate(model))
    return history


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


def both(
    make: Callable[[], nn.Module],
    opt: str,
    run: Callable[[nn.Module, torch.optim.Optimizer], list[Any]],
    engine: th.Engine,
    *,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """The loop with and without th.shard (the same seed before each); asserts the same
    history, weights and optimizer state."""
    model = make()
    ref = copy.deepcopy(model)
    ref_opt = OPTIMIZERS[opt](ref.parameters())
    optimizer = OPTIMIZERS[opt](model.parameters())
    model, optimizer = th.shard(model, optimizer, engine=engine)
    sched = scheduler(optimizer) if scheduler else None
    ref_sched = scheduler(ref_opt) if scheduler else None
    torch.manual_seed(11)
    got = run(model, optimizer) if sched is None else run_with(run, model, optimizer, sched)
    torch.manual_seed(11)
    want = run(ref, ref_opt) if ref_sched is None else run_with(run, ref, ref_opt, ref_sched)
    assert got == want
    assert_same(model, ref)
    assert_same_optimizer(optimizer.state_dict(), ref_opt.state_dict())
    return model, ref, optimizer, ref_opt


def run_with(run: Any, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> list[Any]:
    return run(model, opt, sched)  # type: ignore[no-any-return]


# -- exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ["sgd", "adam", "adamw"])
def test_mlp_clip_accumulate_scheduler_eval_exact(opt: str, engine: th.Engine) -> None:
    # BatchNorm, two Dropouts, clip_grad_norm_ between backward and step, 2 backward per
    # step, a StepLR made on the returned optimizer, model.eval() + no_grad accuracy.
    data, held = batches(6), batches(2, seed=7)

    def run(model: nn.Module, o: torch.optim.Optimizer, sched: Any) -> list[Any]:
        return train(
            model,
            o,
            data,
            classify,
            clip=0.5,
            accumulate=2,
            scheduler=sched,
            evaluate=lambda m: accuracy(m, held),
        )

    model, _, optimizer, _ = both(
        mlp,
        opt,
        run,
        engine,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    )
    assert len(model.__dict__["_th_shard"].loop.shards) >= 3
    assert (
        optimizer.param_groups[0]["lr"]
        != OPTIMIZERS[opt]([nn.Parameter(torch.ones(1))]).param_groups[0]["lr"]
    )


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_clipping_the_model_s_parameters_leaves_the_states_where_they_are(
    opt: str, syncs: list[int]
) -> None:
    """``clip_grad_norm_(model.parameters(), c)`` between backward and step clips shard by
    shard (th.shard's hook of it): the gradients stay on their devices (no step brings
    the state home), and the run is bit-equal to
    plain, clipping norms included. A list of the parameters clips at home, as ever."""
    data = batches(6)
    counted: list[int] = []

    def run(model: nn.Module, o: torch.optim.Optimizer) -> list[Any]:
        before = len(syncs)
        history = train(model, o, data, classify, clip=0.5, accumulate=2)
        counted.append(len(syncs) - before)
        return history

    with th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=1) as eng:
        model, *_ = both(mlp, opt, run, eng)
        shards = len(model.__dict__["_th_shard"].loop.shards)
        assert shards >= 3
        # The first clip takes the norms by an op per shard; later ones use the norms
        # each shard's backward op took (3 clips here), so no shard is copied in again.
        norm_ops = [e for e in eng.trace.events if e.op == "S"]
        assert len(norm_ops) <= shards + 1, (len(norm_ops), shards)
    assert counted[0] == 0, counted  # the sharded run: no sync

    def listed(model: nn.Module, o: torch.optim.Optimizer) -> list[Any]:
        history: list[Any] = []
        for batch in data[:2]:
            o.zero_grad()
            classify(model, batch).backward()
            history.append(float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)))
            o.step()
        return history

    with th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=1) as eng:
        before = len(syncs)
        both(mlp, opt, listed, eng)
        assert len(syncs) > before  # the list took the state home, and clipped it there


def test_clipping_by_value_clamps_each_shard_before_its_step(
    syncs: list[int],
) -> None:
    """``clip_grad_value_(model.parameters(), c)`` between backward and step clamps each
    shard's gradients before its step, on its device: bit-equal to plain, nothing brought
    home (``LoopRunner.sync`` never called), no op of its own."""
    data = batches(6)
    counted: list[tuple[int, int]] = []  # the sharded run's (syncs, step ops)

    def run(model: nn.Module, o: torch.optim.Optimizer) -> list[Any]:
        before = (len(syncs), len(steps()))
        losses = []
        for batch in data:
            o.zero_grad()
            loss = classify(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.01)
            o.step()
            losses.append(float(loss))
        counted.append((len(syncs) - before[0], len(steps()) - before[1]))
        return losses

    with th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=1) as eng:

        def steps() -> list[Any]:
            return [e for e in eng.trace.events if e.op == "S"]

        model, *_ = both(mlp, "adam", run, eng)
        assert len(model.__dict__["_th_shard"].loop.shards) >= 3
    assert counted[0] == (0, 0), counted


def test_clipping_a_non_finite_norm_raises_as_torch(engine: th.Engine, syncs: list[int]) -> None:
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` shard by shard: a non-finite
    total raises torch's own error before any gradient is scaled, nothing brought home;
    a finite one clips exactly as plain."""
    model = mlp()
    ref = copy.deepcopy(model)
    model = th.shard(model, engine=engine)
    x, y = batches(1)[0]
    for m in (model, ref):
        torch.manual_seed(3)  # the same dropout in both
        (classify(m, (x, y)) * float("inf")).backward()  # non-finite gradients
    with pytest.raises(RuntimeError) as want:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as got:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert str(got.value) == str(want.value) and "non-finite" in str(got.value)
    assert syncs == []
    for m in (model, ref):
        m.zero_grad()
        torch.manual_seed(4)
        classify(m, (x, y)).backward()
    want_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, error_if_nonfinite=True)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, error_if_nonfinite=True)
    assert torch.equal(total, want_total) and syncs == []
    grads = {n: p.grad for n, p in model.named_parameters()}  # brings the state home
    for n, p in ref.named_parameters():
        assert torch.equal(grads[n], p.grad), n
    th.unshard(model)


@pytest.mark.parametrize("copying", [True, False])
def test_convnet_sgd_momentum_exact(copying: bool) -> None:
    # Ray Tune's MNIST ConvNet (a traced module), on copying devices and in place.
    data = conv_data()
    devices = ["cpu", "cpu"] if copying else ["cpu"]
    with th.Engine(devices=devices, copy_on_cpu=copying, max_layers_per_shard=1) as eng:

        def run(model: nn.Module, o: torch.optim.Optimizer) -> list[Any]:
            return train(model, o, data, classify, evaluate=lambda m: accuracy(m, data[:2]))

        torch.manual_seed(0)
        model, *_ = both(convnet, "sgd", run, eng)
        assert isinstance(model, ConvNet)
        assert len(model.__dict__["_th_shard"].loop.shards) >= 2


def test_gpt2_hf_loop_exact(engine: th.Engine) -> None:
    # out = model(**batch); out.loss.backward(); GPT-2's tied lm_head; dropout on.
    data = lm_data()

    def evaluate(model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            return float(model(**data[0]).logits.double().sum())

    def run(model: nn.Module, o: torch.optim.Optimizer, sched: Any) -> list[Any]:
        return train(model, o, data, hf_loss, clip=1.0, scheduler=sched, evaluate=evaluate)

    model, ref, *_ = both(
        gpt2,
        "adamw",
        run,
        engine,
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    # Called positionally and with labels inside, the output type is the model's.
    out = model(data[1]["input_ids"], labels=data[1]["labels"])
    assert type(out) is type(ref(data[1]["input_ids"], labels=data[1]["labels"]))


def test_shuffling_dataloader_and_dropout_share_the_global_stream(engine: th.Engine) -> None:
    # On the main thread the loop's ops draw from torch's global generator, handed over at
    # each op: the DataLoader's shuffle (drawn on the user's thread) and the dropout masks
    # (drawn in the ops) interleave as in plain PyTorch.
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(4)
    x, y = (
        torch.randn(24, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 4, (24,), generator=g),
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)

    def run(model: nn.Module, o: torch.optim.Optimizer) -> list[Any]:
        out = train(model, o, loader, classify, epochs=3)  # type: ignore[arg-type]
        out.append(torch.rand(()).item())  # the user's own draw after the loop
        return out

    both(mlp, "sgd", run, engine)


def test_no_grad_eval_keeps_nothing(engine: th.Engine) -> None:
    model = th.shard(mlp(), engine=engine)
    x = batches(1)[0][0]
    model.eval()
    with torch.no_grad():
        y = model(x)
    assert not y.requires_grad and y.grad_fn is None
    model.train()
    y = model(x)
    assert y.requires_grad and y.device == x.device


def test_checkpoint_mid_run_round_trips_with_plain(engine: th.Engine) -> None:
    # Saved mid-run from the sharded loop, loaded into a fresh plain model/optimizer (and
    # a plain checkpoint into a fresh sharded one): both go on exactly as the plain run.
    data = batches(4)
    model = mlp()
    fresh, fresh2, ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS["adam"](model.parameters()), OPTIMIZERS["adam"](ref.parameters())
    model, opt = th.shard(model, opt, engine=engine)
    torch.manual_seed(5)
    train(model, opt, data, classify, epochs=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    rng = torch.get_rng_state()
    torch.manual_seed(5)
    train(ref, ref_opt, data, classify, epochs=1)
    assert torch.equal(rng, torch.get_rng_state())  # dropout drew the same numbers
    assert_same(model, ref)
    assert_same_optimizer(opt.state_dict(), ref_opt.state_dict())
    buf.seek(0)
    ckpt = torch.load(buf)
    fresh_opt = OPTIMIZERS["adam"](fresh.parameters())
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    plain_ckpt = copy.deepcopy({"model": ref.state_dict(), "opt": ref_opt.state_dict()})
    fresh2_opt = OPTIMIZERS["adam"](fresh2.parameters())
    fresh2, fresh2_opt = th.shard(fresh2, fresh2_opt, engine=engine)
    fresh2.load_state_dict(plain_ckpt["model"])
    fresh2_opt.load_state_dict(plain_ckpt["opt"])
    runs = [(fresh, fresh_opt), (fresh2, fresh2_opt), (ref, ref_opt)]
    got = []
    for m, o in runs:
        torch.manual_seed(6)
        got.append(train(m, o, data, classify, epochs=1))
    assert got[0] == got[2] and got[1] == got[2]
    assert_same(fresh, ref)
    assert_same(fresh2, ref)
    # Loaded into the sharded model mid-run (after its cut) too (a fresh load: the plain
    # optimizer above took ckpt's tensors as its state, and trained them).
    buf.seek(0)
    ckpt = torch.load(buf)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    torch.manual_seed(6)
    assert train(model, opt, data, classify, epochs=1) == got[2]
    assert_same(model, ref)


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_loops_in_threads_multiplexed_exact(kept: bool, request: pytest.FixtureRequest) -> None:
    # Three loops in threads on 2 emulated copying devices, each exact against its plain
    # run; their ops interleave on the devices (recomputing, or keeping their graphs).
    engine = request.getfixturevalue("kept_engine" if kept else "engine")
    specs = [
        (mlp, "sgd", batches(5)),
        (mlp, "adamw", batches(5, seed=3)),
        (convnet, "adam", conv_data(3)),
    ]
    models, refs, opts, ref_opts = [], [], [], []
    for i, (make, opt, _) in enumerate(specs):
        torch.manual_seed(i)
        m = make()
        refs.append(copy.deepcopy(m))
        models.append(m)
        opts.append(OPTIMIZERS[opt](m.parameters()))
        ref_opts.append(OPTIMIZERS[opt](refs[-1].parameters()))
    lock = threading.Lock()
    results: dict[int, Any] = {}
    sharded = threading.Barrier(len(specs) + 1)

    def loop(i: int) -> None:
        try:
            with lock:  # th.shard's private stream starts from this seed
                torch.manual_seed(100 + i)
                m, o = th.shard(models[i], opts[i], engine=engine)
            sharded.wait(60)  # the main thread's loop seeds after this
            results[i] = train(m, o, specs[i][2], classify, clip=1.0)
        except BaseException as err:
            results[i] = err

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(specs))]
    # And one on the main thread meanwhile: its ops draw from torch's global generator,
    # which the other loops' ops (on their private streams) leave as it was.
    main, main_ref = mlp(seed=9), mlp(seed=9)
    main_opt = OPTIMIZERS["adam"](main.parameters())
    main, main_opt = th.shard(main, main_opt, engine=engine)
    for t in threads:
        t.start()
    sharded.wait(60)
    torch.manual_seed(99)
    got = train(main, main_opt, batches(5), classify)
    for t in threads:
        t.join(300)
    torch.manual_seed(99)
    assert got == train(main_ref, OPTIMIZERS["adam"](main_ref.parameters()), batches(5), classify)
    assert_same(main, main_ref)
    for i in range(len(specs)):
        assert not isinstance(results[i], BaseException), results[i]
        torch.manual_seed(100 + i)
        assert results[i] == train(refs[i], ref_opts[i], specs[i][2], classify, clip=1.0)
        assert_same(models[i], refs[i])
    busy = [d["busy_s"] for d in engine.summary()["devices"].values()]
    assert all(b > 0 for b in busy)


# -- kept graphs ---------------------------------------------------------------------------


@pytest.fixture
def kept_engine() -> Iterator[th.Engine]:
    """2 emulated copying devices with ``recompute=False`` (loops keep their graphs), at
    most 1 layer a shard."""
    eng = th.Engine(
        devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=1, recompute=False
    )
    yield eng
    eng.close()


@pytest.mark.parametrize("kind", ["mlp", "convnet", "gpt2"])
def test_kept_graphs_exact(kind: str, kept_engine: th.Engine) -> None:
    # recompute=False: each forward op keeps its shard's graph on its device for the
    # backward op; BatchNorm, dropout, clip, 2 backward per step, a scheduler, eval; the
    # ConvNet; GPT-2's tied weights and HF loop.
    data: Any = batches(6) if kind == "mlp" else conv_data() if kind == "convnet" else lm_data()
    loss_of = hf_loss if kind == "gpt2" else classify

    def evaluate(model: nn.Module) -> float:
        if kind != "gpt2":
            return accuracy(model, data[:2])
        model.eval()
        with torch.no_grad():
            return float(model(**data[0]).logits.double().sum())

    def run(model: nn.Module, o: torch.optim.Optimizer, sched: Any) -> list[Any]:
        accumulate = 2 if kind == "mlp" else 1
        return train(
            model,
            o,
            data,
            loss_of,
            clip=0.5,
            accumulate=accumulate,
            scheduler=sched,
            evaluate=evaluate,
        )

    make = {"mlp": mlp, "convnet": convnet, "gpt2": gpt2}[kind]
    model, *_ = both(
        make,
        "adamw",
        run,
        kept_engine,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    )
    loop = model.__dict__["_th_shard"].loop
    assert loop.keep and len(loop.shards) >= 2
    assert not loop.keeps_batch  # every batch's graphs were back-propagated and let go


def test_kept_graph_reserved_on_its_device_until_backward(kept_engine: th.Engine) -> None:
    # The engine holds the batch's reservation (and its ops on one device) between the
    # user's forward and backward, while no op of the loop is ready, and lets it go after
    # the first shard's backward; a graph the user drops is let go at the next op.
    model = th.shard(mlp(), engine=kept_engine)
    (x, y), (x2, _) = batches(2)
    loss = F.cross_entropy(model(x), y)
    name = kept_engine.tasks()[0]
    assert kept_engine.kept_on(name) is not None
    loss.backward()
    assert kept_engine.kept_on(name) is None
    assert all(p.grad is not None for p in model.parameters())
    out = model(x2)
    assert kept_engine.kept_on(name) is not None
    del out
    gc.collect()
    model.eval()
    with torch.no_grad():
        model(x2)
    assert kept_engine.kept_on(name) is None


def test_kept_graphs_fall_back_to_recompute_over_budget() -> None:
    # A batch whose kept activations would not fit device_memory recomputes (a ModelTask
    # is refused there): exact all the same, nothing reserved.
    def wide() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.1)]
        layers += [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)]
        return nn.Sequential(*layers).double()

    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(256, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (256,)))
        for _ in range(3)
    ]
    with th.Engine(
        devices=["cpu", "cpu"],
        copy_on_cpu=True,
        recompute=False,
        max_layers_per_shard=2,
        device_memory="512KiB",
    ) as eng:
        model, *_ = both(wide, "sgd", lambda m, o: train(m, o, data, classify), eng)
        loop = model.__dict__["_th_shard"].loop
        assert not loop.keep
        assert loop.plan.kept_peak_bytes() > loop.plan.budget
        model(data[0][0])
        assert eng.kept_on(loop.name) is None


class GlobalDraws:
    """A thread drawing from torch's global generator without any lock, as user code in
    another thread does (weight init, a shuffling DataLoader), until stopped; it checks
    that nothing else drew from that generator meanwhile."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.got: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        torch.manual_seed(self.seed)
        while not self.stop.is_set():
            self.got.append(torch.rand(()).item())

    def __enter__(self) -> GlobalDraws:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)
        assert len(self.got) > 10  # it drew while the loops ran
        torch.manual_seed(self.seed)
        assert self.got == torch.rand(len(self.got)).tolist()


def dropout_mlp() -> nn.Module:
    """An MLP with dropout, initialised from whatever generator the thread draws from."""
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Dropout(0.2)
    ).double()


def test_other_threads_global_draws_stay_out_of_loops_ops(engine: th.Engine) -> None:
    # Two loops in threads (their own streams, dropout on) while a third thread draws from
    # torch's global generator without a lock the whole time: the loops' ops never touch
    # that generator, so both the loops and that thread get exactly their plain numbers.
    data = [batches(4, seed=5), batches(4, seed=6)]
    lock = threading.Lock()
    built = threading.Barrier(3)
    results: dict[int, Any] = {}
    models: dict[int, nn.Module] = {}

    def loop(i: int) -> None:
        try:
            with lock:
                torch.manual_seed(20 + i)
                model = dropout_mlp()
                models[i] = copy.deepcopy(model)
                opt = OPTIMIZERS["adam"](model.parameters())
                model, opt = th.shard(model, opt, engine=engine)
            built.wait(60)
            results[i] = train(model, opt, data[i], lambda m, b: m(b[0]).pow(2).mean())
        except BaseException as err:
            results[i] = err
            built.abort()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    built.wait(60)
    with GlobalDraws(seed=77):
        for t in threads:
            t.join(300)
    for i in range(2):
        assert not isinstance(results[i], BaseException), results[i]
        ref = models[i]
        torch.manual_seed(20 + i)
        dropout_mlp()  # the plain run's generator where the sharded one's stream started
        want = train(
            ref, OPTIMIZERS["adam"](ref.parameters()), data[i], lambda m, b: m(b[0]).pow(2).mean()
        )
        assert results[i] == want


def test_private_generator_thread_shares_it_with_its_loop(engine: th.Engine) -> None:
    # A function run in a thread on a private generator (th.optimize's objectives, the Ray
    # front end's function trainables: registration.factory.private_rng) builds its
    # model, shuffles its DataLoader and draws dropout from that one stream, as the same
    # function does alone: exact with th.shard, with another thread drawing from the
    # global generator all along.
    from torch.utils.data import DataLoader, TensorDataset

    from tune_hydra.engine.registration.factory import private_rng

    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(24, 8, generator=g, dtype=torch.float64), torch.randn(24, 16, generator=g)

    def function(shard: bool) -> list[Any]:
        model = dropout_mlp()
        opt = OPTIMIZERS["sgd"](model.parameters())
        if shard:
            model, opt = th.shard(model, opt, engine=engine)
        loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)
        out = train(model, opt, loader, lambda m, b: F.mse_loss(m(b[0]), b[1]), epochs=2)  # type: ignore[arg-type]
        out.append(torch.rand(()).item())  # the function's own draw after its loop
        out.append([p.detach().clone() for p in model.parameters()])
        return out

    results: list[Any] = []

    def in_thread() -> None:
        try:
            with private_rng(seed=5):
                results.append(function(True))
        except BaseException as err:
            results.append(err)

    with GlobalDraws(seed=3):
        t = threading.Thread(target=in_thread)
        t.start()
        t.join(300)
    with private_rng(seed=5):
        want = function(False)
    got = results[0]
    assert not isinstance(got, BaseException), got
    assert got[:-1] == want[:-1]
    assert all(torch.equal(a, b) for a, b in zip(got[-1], want[-1], strict=True))


def test_a_main_thread_loop_draws_from_the_global_generator_beside_a_private_one(
    engine: th.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The main thread's loop: its stream is torch's global generator, so its ops draw from
    # that generator (swapped in under the engine's RNG lock) rather than under the per-op
    # dispatch mode (every aten op through Python: ~25% of a CPU forward). Meanwhile a
    # thread on a private generator trains its own loop on the same engine under that
    # mode. Each equals its plain run.
    from tune_hydra.engine.registration.factory import private_rng
    from tune_hydra.engine.runtime import loop as loop_mod

    modes: list[str] = []  # the ops that ran under it (the cut's probe runs on the caller)
    real = loop_mod.use_generator

    def counted(gen: torch.Generator) -> Any:
        if threading.current_thread() is not threading.main_thread():
            modes.append(threading.current_thread().name)
        return real(gen)

    monkeypatch.setattr(loop_mod, "use_generator", counted)
    data = [batches(4, seed=5), batches(4, seed=6)]
    loss = lambda m, b: m(b[0]).pow(2).mean()  # noqa: E731

    def run(shard: bool, seed: int, i: int) -> tuple[list[Any], dict[str, Any]]:
        torch.manual_seed(seed)
        model = dropout_mlp()
        opt = OPTIMIZERS["adam"](model.parameters())
        if shard:
            model, opt = th.shard(model, opt, engine=engine)
        out = train(model, opt, data[i], loss)
        out.append(torch.rand(()).item())  # the stream after the loop
        return out, copy.deepcopy(model.state_dict())

    alone, _ = run(True, 30, 0)
    assert modes == []  # the main thread's loop alone: no dispatch mode
    results: list[Any] = []

    def in_thread() -> None:
        try:
            with private_rng(seed=5):
                results.append(run(True, 31, 1))
        except BaseException as err:
            results.append(err)

    t = threading.Thread(target=in_thread)
    t.start()
    got_main = run(True, 30, 0)
    t.join(300)
    assert not isinstance(results[0], BaseException), results[0]
    assert modes  # the private thread's loop ran under the mode
    want_main = run(False, 30, 0)
    with private_rng(seed=5):
        want_thread = run(False, 31, 1)
    assert got_main[0] == want_main[0] == alone
    assert results[0][0] == want_thread[0]
    assert_same(got_main[1], want_main[1])
    assert_same(results[0][1], want_thread[1])


# -- the returned objects behave as the user's --------------------------------------------


def test_model_and_optimizer_stay_the_users(engine: th.Engine) -> None:
    model = mlp()
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    same_model, same_opt = th.shard(model, opt, engine=engine)
    assert same_model is model and same_opt is opt
    assert isinstance(model, nn.Sequential) and isinstance(opt, torch.optim.SGD)
    assert model.to("cuda") is model and model.cuda() is model  # placement is the engine's
    model(batches(1)[0][0])
    with pytest.raises(UnsupportedCallError, match="keeps its dtype after its first forward"):
        model.to(torch.float32)
    assert list(model.state_dict()) == keys
    restored = th.unshard(model)
    assert type(restored) is nn.Sequential and type(opt) is torch.optim.SGD
    assert engine.tasks() == []


@pytest.mark.parametrize("how", ["double", "to", "parent"])
def test_dtype_conversion_before_the_first_forward_exact(how: str, engine: th.Engine) -> None:
    """``model.double()``, ``model.to(torch.float64)`` and a parent module's conversion
    (Lightning's ``precision="64-true"`` converts the LightningModule holding the sharded
    network; its ``model.to(device)`` too) convert a sharded float32 model before its first
    forward, the optimizer keeping its parameters: trains as plain ``double()``; a parent's
    move to a device is ignored (placement is the engine's)."""
    data = batches(3, seed=4)
    ref = mlp(torch.float32).double()
    model = mlp(torch.float32)
    ids = [id(p) for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    th.shard(model, opt, engine=engine)
    parent = nn.ModuleDict({"net": model})
    {"double": model.double, "to": lambda: model.to(torch.float64), "parent": parent.double}[how]()
    parent.to("cpu")
    assert [id(p) for p in model.parameters()] == ids
    floats = [t for t in model.state_dict().values() if t.is_floating_point()]
    assert all(t.dtype == torch.float64 for t in floats)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ref, ref_opt)):
        torch.manual_seed(2)  # the same dropout masks
        for x, y in data:
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    parent.to("cpu")  # after the cut: a no-op still
    with pytest.raises(UnsupportedCallError, match="keeps its dtype after its first forward"):
        parent.float()
    th.unshard(model)


def test_a_parent_modules_view_of_the_model_is_synced(engine: th.Engine) -> None:
    """A module holding the sharded model (a LightningModule) reaches its tensors through
    torch's recursion, not the model's own methods: ``parent.zero_grad()`` right after
    ``step()`` (Lightning's before each validation) keeps the pending step, and
    ``clip_grad_norm_(parent.parameters())`` clips the real gradients: exact as plain."""
    data = batches(4, seed=6)
    ref = nn.ModuleDict({"net": mlp()})
    parent = copy.deepcopy(ref)
    opt = torch.optim.Adam(parent.parameters(), lr=1e-2)
    model, opt = th.shard(parent["net"], opt, engine=engine)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    norms = []
    for p, o in ((parent, opt), (ref, ref_opt)):
        torch.manual_seed(3)  # the same dropout masks
        for x, y in data:
            F.cross_entropy(p["net"](x), y).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(p.parameters(), 0.5)))
            o.step()
            p.zero_grad()
    assert norms[:4] == norms[4:]
    for (k, a), b in zip(parent.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    # The parent's load_state_dict (Lightning restoring a checkpoint) with a step still
    # pending in the shards: the step applies, then the loaded weights win, as plain.
    loaded = nn.ModuleDict({"net": mlp(seed=5)}).state_dict()
    for p, o in ((parent, opt), (ref, ref_opt)):
        torch.manual_seed(4)
        for x, y in data[:2]:
            F.cross_entropy(p["net"](x), y).backward()
            o.step()
            if x is data[0][0]:
                p.load_state_dict(loaded)
    for (k, a), b in zip(parent.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    th.unshard(model)


def test_garbage_collected_model_leaves_the_engine(engine: th.Engine) -> None:
    model = mlp()
    model = th.shard(model, engine=engine)
    model(batches(1)[0][0]).sum().backward()
    assert len(engine.tasks()) == 1
    del model
    gc.collect()
    for _ in range(100):
        if not engine.tasks():
            break
        threading.Event().wait(0.05)
    assert engine.tasks() == []


def test_default_engine_and_configure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_mod, "_ENGINE", None)
    monkeypatch.setattr(shard_mod, "_CONFIG", {})
    th.configure(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=3)
    model = th.shard(mlp())
    try:
        model(batches(1)[0][0])
        eng = shard_mod._ENGINE
        assert eng is not None and len(eng.workers) == 2 and eng.copy_on_cpu
        with pytest.raises(EngineConfiguredError, match=r"before the first th\.shard"):
            th.configure(devices="cpu")
    finally:
        th.unshard(model)
        if shard_mod._ENGINE is not None:
            shard_mod._ENGINE.close()


# -- bad input ------------------------------------------------------------------------------


def test_bad_input(engine: th.Engine) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OptimizerMismatchError, match="not the model's"):
        th.shard(model, torch.optim.SGD(mlp(seed=1).parameters(), lr=0.1), engine=engine)
    th.shard(model, opt, engine=engine)
    with pytest.raises(AlreadyShardedError, match="once per model"):
        th.shard(model, engine=engine)
    with pytest.raises(AlreadyShardedError):
        th.shard(mlp(), opt, engine=engine)
    with pytest.raises(ModelOnDeviceError, match="meta"):
        th.shard(mlp().to("meta"), engine=engine)
    with pytest.raises(UnsupportedCallError, match="one input"):
        model(torch.ones(1), torch.ones(1))
    zero = torch.zeros(())
    assert opt.step(lambda: zero) is zero  # step(closure): the closure's loss
    th.unshard(model)
    for err in (AlreadyShardedError, OptimizerMismatchError, ShardClosedError):
        assert issubclass(err, TuneHydraError)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Boom.apply(x) if self.armed else x


def test_loop_raising_mid_backward_leaves_others_exact(engine: th.Engine) -> None:
    torch.manual_seed(0)
    bad_model = nn.Sequential(nn.Linear(8, 8), Boom(), nn.Linear(8, 4)).double()
    good = [mlp(seed=i) for i in range(2)]
    refs = [copy.deepcopy(m) for m in good]
    data = batches(5)
    results: dict[str, Any] = {}
    lock = threading.Lock()

    def failing() -> None:
        with lock:
            m, o = th.shard(
                bad_model, torch.optim.SGD(bad_model.parameters(), lr=0.1), engine=engine
            )
        train(m, o, data[:1], classify, epochs=1)
        results["name"] = m.__dict__["_th_shard"].loop.name
        bad_model[1].armed = True
        try:
            train(m, o, data, classify, epochs=1)
        except RuntimeError as err:
            results["bad"] = err
        th.unshard(m)

    def good_loop(i: int) -> None:
        with lock:
            torch.manual_seed(7 + i)
            m, o = th.shard(good[i], OPTIMIZERS["adam"](good[i].parameters()), engine=engine)
        results[i] = train(m, o, data, classify)

    threads = [threading.Thread(target=failing)] + [
        threading.Thread(target=good_loop, args=(i,)) for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert "boom in backward" in str(results["bad"])
    for i in range(2):
        torch.manual_seed(7 + i)
        assert results[i] == train(
            refs[i], OPTIMIZERS["adam"](refs[i].parameters()), data, classify
        )
        assert_same(good[i], refs[i])
    names = engine.tasks()
    assert len(names) == 2 and results["name"] not in names


def test_param_groups_manual_lr_and_model_zero_grad_exact(engine: th.Engine) -> None:
    # Two param groups (no weight decay on biases and norms), the lr set by hand between
    # steps, model.zero_grad(set_to_none=False) instead of the optimizer's.
    data = batches(4)

    def groups(m: nn.Module) -> torch.optim.Optimizer:
        decay = [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() > 1]
        rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=1e-2,
        )

    def run(model: nn.Module, o: torch.optim.Optimizer) -> list[Any]:
        out = []
        for i, (x, y) in enumerate(data * 2):
            model.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            o.param_groups[i % 2]["lr"] = 1e-2 / (1 + i)
            o.step()
            out.append(loss.item())
        return out

    model = mlp()
    ref = copy.deepcopy(model)
    opt, ref_opt = groups(model), groups(ref)
    model, opt = th.shard(model, opt, engine=engine)
    torch.manual_seed(3)
    got = run(model, opt)
    torch.manual_seed(3)
    assert got == run(ref, ref_opt)
    assert_same(model, ref)
    assert_same_optimizer(opt.state_dict(), ref_opt.state_dict())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_moved_to_a_gpu_before_shard_trains_as_plain() -> None:
    # Ray's examples call model.to(device) before the line th.shard is added after: the
    # model is brought back to host memory (its Parameters kept, the optimizer's state
    # too) and trains exactly as the plain loop on that GPU.
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()

    data = [(x.cuda(), y.cuda()) for x, y in batches(4)]

    def loss_of(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    plain = net().cuda()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    want = train(plain, plain_opt, data, loss_of)

    eng = th.Engine(devices="cuda", device_memory="1GiB")
    try:
        model = net().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        params = list(model.parameters())
        model, opt = th.shard(model, opt, engine=eng)
        assert [p.device.type for p in params] == ["cpu"] * len(params)
        assert train(model, opt, data, loss_of) == want
        home = th.unshard(model)
        for a, b in zip(home.state_dict().values(), plain.state_dict().values(), strict=True):
            assert torch.equal(a, b.cpu())
    finally:
        eng.close()
