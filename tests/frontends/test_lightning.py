"""Lightning's ``Trainer`` over a LightningModule whose network is ``th.shard``-ed.

Every run is compared with the same LightningModule trained by plain Lightning (no
``th.shard``, no strategy) with ``precision="64-true"``: per-step training losses, final
weights and the optimizer's state equal exactly. The runs validate between epochs
(Lightning zeroes the LightningModule's gradients there, and runs its sanity check
first) and clip gradients (Lightning reads them through the optimizer's parameters).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tune_hydra as th
from tune_hydra.exceptions import NotShardedError, OptimizerMismatchError

pl = pytest.importorskip("lightning.pytorch")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (see the shared fixture)."""


def net() -> nn.Sequential:
    """Three shards on the ``engine`` fixture (at most 2 layers each), float32 (Lightning's
    ``64-true`` converts it)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


class LitNet(pl.LightningModule):
    """The user's LightningModule; ``where`` says where it shards its network."""

    def __init__(self, network: nn.Module, engine: th.Engine | None, where: str = "") -> None:
        super().__init__()
        self.engine, self.where = engine, where
        in_init = where in ("init", "configure_optimizers")
        self.network = th.shard(network, engine=engine) if in_init else network
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.where == "configure_model" and "_th_shard" not in self.network.__dict__:
            self.network = th.shard(self.network, engine=self.engine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(self.network.parameters(), lr=1e-2)
        if self.where == "configure_optimizers":  # without HydraStrategy: by hand
            th.shard(self.network, opt)
        return opt


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 8, generator=g), torch.randint(0, 4, (24,), generator=g))
    return DataLoader(data, batch_size=6), DataLoader(data, batch_size=12)


def trainer(tmp_path: Path, **kwargs: Any) -> Any:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "precision": "64-true",
        "max_epochs": 2,
        "gradient_clip_val": 0.5,
        "enable_progress_bar": False,
        "logger": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    return pl.Trainer(**{**options, **kwargs})


def fit(model: LitNet, tmp_path: Path, *, validate_first: bool = False, **kwargs: Any) -> Any:
    train, val = loaders()
    t = trainer(tmp_path, **kwargs)
    if validate_first:
        t.validate(model, val, verbose=False)
    t.fit(model, train, val)
    return t


def assert_same(got: LitNet, got_trainer: Any, want: LitNet, want_trainer: Any) -> None:
    assert len(got.losses) == 8 and got.losses == want.losses
    a, b = got.state_dict(), want.state_dict()
    assert list(a) == list(b)
    assert all(t.dtype == torch.float64 for t in a.values())
    for k in b:
        assert torch.equal(a[k], b[k]), k
    sa, sb = got_trainer.optimizers[0].state_dict(), want_trainer.optimizers[0].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sb["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(sa["state"][i][k]), torch.as_tensor(v)), (i, k)


@pytest.mark.parametrize(
    ("where", "validate_first"),
    [("init", False), ("configure_model", False), ("init", True), ("configure_optimizers", False)],
    ids=["init", "configure_model", "validate-then-fit", "by-hand-no-strategy"],
)
def test_lightning_trainer_exact(
    where: str, validate_first: bool, engine: th.Engine, tmp_path: Path
) -> None:
    """The network sharded in ``__init__`` or ``configure_model`` under
    ``strategy=th.HydraStrategy()`` (or its optimizer given by hand in
    ``configure_optimizers``, no strategy): the optimizer steps shard by shard (3
    shards), and training equals plain Lightning's, float64-exact. ``validate`` before
    ``fit`` cuts the network without an optimizer: it is cut again with it."""
    plain = LitNet(net(), None)
    plain_trainer = fit(plain, tmp_path / "plain", validate_first=validate_first)
    model = LitNet(net(), engine, where)
    kwargs = {} if where == "configure_optimizers" else {"strategy": th.HydraStrategy()}
    sharded_trainer = fit(model, tmp_path / "sharded", validate_first=validate_first, **kwargs)
    opt = sharded_trainer.optimizers[0]
    assert "_th_shard" in opt.__dict__  # given to the sharded network
    assert len(model.network.__dict__["_th_shard"].loop.shards) == 3
    assert len(engine.tasks()) == 1
    assert_same(model, sharded_trainer, plain, plain_trainer)
    metrics = sharded_trainer.callback_metrics, plain_trainer.callback_metrics
    assert metrics[0]["val_loss"] == metrics[1]["val_loss"]
    th.unshard(model.network)
    assert engine.tasks() == []


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_leaves_the_states_where_they_are(
    algorithm: str, engine: th.Engine, tmp_path: Path, syncs: list[int]
) -> None:
    """``gradient_clip_val`` clips every step through the precision plugin's
    ``main_params(optimizer)``: by norm or by value, shard by shard with the gradients
    on their devices (no more syncs than a run without clipping), exactly as plain
    Lightning's run."""
    counts = []
    for clip in (0.5, None):
        kwargs = {"gradient_clip_val": clip, "gradient_clip_algorithm": algorithm}
        plain = LitNet(net(), None)
        plain_trainer = fit(plain, tmp_path / f"plain{clip}", **kwargs)
        model = LitNet(net(), engine, "init")
        before = len(syncs)
        got = fit(model, tmp_path / f"sharded{clip}", strategy=th.HydraStrategy(), **kwargs)
        counts.append(len(syncs) - before)
        assert_same(model, got, plain, plain_trainer)
        th.unshard(model.network)
    assert counts[0] == counts[1], counts


class GroupedNet(LitNet):
    """Two param groups, not in the network's order (biases first, without weight decay):
    the clipping norm sums over the optimizer's order, as plain Lightning's."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        named = list(nn.Module.named_parameters(self.network))
        biases = [p for n, p in named if n.endswith("bias")]
        weights = [p for n, p in named if not n.endswith("bias")]
        groups = [{"params": biases[::-1], "weight_decay": 0.0}, {"params": weights}]
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def test_clipping_over_param_groups_in_another_order_exact(
    engine: th.Engine, tmp_path: Path
) -> None:
    plain = GroupedNet(net(), None)
    fit(plain, tmp_path / "plain", precision="32-true", gradient_clip_val=0.05)
    model = GroupedNet(net(), engine, "init")
    got = fit(
        model,
        tmp_path / "sharded",
        precision="32-true",
        gradient_clip_val=0.05,
        strategy=th.HydraStrategy(),
    )
    assert model.losses == plain.losses
    for (k, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    th.unshard(model.network)
    assert got.optimizers[0].param_groups[0]["weight_decay"] == 0.0


def test_hydra_strategy_without_a_sharded_network_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(NotShardedError, match=r"th\.shard\(Net"):
        fit(LitNet(net(), None), tmp_path, strategy=th.HydraStrategy())


def test_an_optimizer_over_sharded_and_other_parameters_is_refused(engine: th.Engine) -> None:
    from tune_hydra.frontends.lightning import give_optimizers

    module = nn.ModuleDict({"net": th.shard(net(), engine=engine), "head": nn.Linear(4, 2)})
    plain_head = torch.optim.SGD(module["head"].parameters(), lr=0.1)
    give_optimizers(module, [plain_head])  # another part's optimizer stays plain
    assert "_th_shard" not in plain_head.__dict__
    with pytest.raises(OptimizerMismatchError, match="one optimizer per sharded network"):
        give_optimizers(module, [torch.optim.SGD(module.parameters(), lr=0.1)])
    first = torch.optim.SGD(module["net"].parameters(), lr=0.1)
    with pytest.raises(OptimizerMismatchError, match="both step"):
        give_optimizers(module, [first, torch.optim.SGD(module["net"].parameters(), lr=0.1)])
    th.unshard(module["net"])


def test_import_without_lightning_says_what_to_install() -> None:
    """``import tune_hydra`` and the module load without Lightning; the strategy says
    what to install."""
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None\n"
        "sys.modules['lightning.pytorch'] = None\n"
        "import tune_hydra as th\n"
        "from tune_hydra.frontends import lightning\n"
        "from tune_hydra.exceptions import MissingDependencyError\n"
        "try:\n"
        "    th.HydraStrategy\n"
        "except MissingDependencyError as err:\n"
        "    assert 'pip install \"tune_hydra[lightning]\"' in str(err), err\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_copy_of_the_lightning_module_is_plain(engine: th.Engine, tmp_path: Path) -> None:
    """``copy.deepcopy`` of the trained LightningModule (a best-model snapshot) holds the
    user's plain network with the trained weights."""
    model = LitNet(net(), engine, "init")
    fit(model, tmp_path, strategy=th.HydraStrategy(), max_epochs=1)
    model.engine = None  # the test's own reference (an engine does not copy)
    snapshot = copy.deepcopy(model)
    assert type(snapshot.network) is nn.Sequential
    for (k, a), b in zip(snapshot.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    th.unshard(model.network)


class ManualNet(LitNet):
    """Manual optimization: the user's training_step steps Lightning's wrapper of the
    optimizer (``self.optimizers()``), which forwards to the sharded one."""

    def __init__(self, network: nn.Module, engine: th.Engine | None, where: str = "") -> None:
        super().__init__(network, engine, where)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(self(x), y)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5)
        opt.step()
        self.losses.append(loss.item())
        return loss


def test_manual_optimization_exact(engine: th.Engine, tmp_path: Path) -> None:
    plain = ManualNet(net(), None)
    plain_trainer = fit(plain, tmp_path / "plain", gradient_clip_val=None)
    model = ManualNet(net(), engine, "init")
    kwargs = {"gradient_clip_val": None, "strategy": th.HydraStrategy()}
    sharded_trainer = fit(model, tmp_path / "sharded", **kwargs)
    assert "_th_shard" in sharded_trainer.optimizers[0].__dict__
    assert_same(model, sharded_trainer, plain, plain_trainer)
    th.unshard(model.network)


def test_resume_from_a_checkpoint_exact(engine: th.Engine, tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` of a sharded run, then a new LightningModule fitted on
    with ``ckpt_path=`` (weights and Adam's state restored into the sharded network and its
    optimizer): as plain Lightning's resume."""
    runs = []
    for engine_or_none, name in ((None, "plain"), (engine, "sharded")):
        where = "init" if engine_or_none is not None else ""
        strategy = {"strategy": th.HydraStrategy()} if engine_or_none is not None else {}
        first = LitNet(net(), engine_or_none, where)
        t = fit(first, tmp_path / name, max_epochs=1, **strategy)
        path = tmp_path / f"{name}.ckpt"
        t.save_checkpoint(path)
        again = LitNet(net(), engine_or_none, where)  # fresh weights: the checkpoint's win
        strategy = {"strategy": th.HydraStrategy()} if engine_or_none is not None else {}
        train, val = loaders()
        t2 = trainer(tmp_path / name, **strategy)
        t2.fit(again, train, val, ckpt_path=path)
        runs.append((again, t2))
        if engine_or_none is not None:
            th.unshard(first.network)
            th.unshard(again.network)
    (plain, plain_trainer), (model, sharded_trainer) = runs
    assert len(model.losses) == 4 and model.losses == plain.losses
    a, b = model.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
    sa, sb = sharded_trainer.optimizers[0].state_dict(), plain_trainer.optimizers[0].state_dict()
    for i, st in sb["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(sa["state"][i][k]), torch.as_tensor(v)), (i, k)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_lightning_bf16_precision_equals_plain(
    precision: str, engine: th.Engine, tmp_path: Path
) -> None:
    """Lightning's bf16 precisions under ``th.HydraStrategy()``: ``bf16-mixed`` (float32
    weights, the steps under Lightning's ``torch.autocast``, which every shard op enters)
    and ``bf16-true`` (the network converted to bfloat16): per-step losses, weights and
    optimizer state equal plain Lightning's at the same precision, bit for bit, and the
    losses differ from a float32 run's (the precision was not dropped). (``16-mixed`` is
    Lightning's ``bf16-mixed`` on a CPU; with fp16 on CUDA its ``GradScaler`` is the one
    ``test_shard_amp.py`` keeps exact.)"""
    runs = {}
    for name, eng, prec in (
        ("plain", None, precision),
        ("sharded", engine, precision),
        ("fp32", None, "32-true"),
    ):
        where = "init" if eng is not None else ""
        strategy = {"strategy": th.HydraStrategy()} if eng is not None else {}
        model = LitNet(net(), eng, where)
        t = fit(model, tmp_path / name, precision=prec, **strategy)
        runs[name] = (model, t)
    (plain, plain_t), (model, sharded_t), (fp32, _) = runs["plain"], runs["sharded"], runs["fp32"]
    assert len(model.losses) == 8 and model.losses == plain.losses
    assert model.losses != fp32.losses
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    a, b = model.state_dict(), plain.state_dict()
    assert list(a) == list(b)
    for k in b:
        assert a[k].dtype == dtype and torch.equal(a[k], b[k]), k
    sa, sb = sharded_t.optimizers[0].state_dict(), plain_t.optimizers[0].state_dict()
    for i, st in sb["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(sa["state"][i][k]), torch.as_tensor(v)), (i, k)
    assert len(model.network.__dict__["_th_shard"].loop.shards) == 3
    th.unshard(model.network)
    assert engine.tasks() == []
