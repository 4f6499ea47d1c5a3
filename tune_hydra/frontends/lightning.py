"""Lightning's ``Trainer`` over a ``LightningModule`` whose network is ``th.shard``-ed.

The LightningModule shards its network where it builds it (one line), and the Trainer
gets one more argument::

    class LitNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = th.shard(Net())  # in __init__ or in configure_model

        def configure_optimizers(self):
            return torch.optim.Adam(self.model.parameters())

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=th.HydraStrategy())

:class:`HydraStrategy` is Lightning's ``SingleDeviceStrategy`` (the batches and the
LightningModule's other parts on one device, ``"cpu"`` by default) with what a sharded
network needs, in the order Lightning's ``Strategy.setup`` calls it:

- ``precision_plugin.convert_module`` (``precision="64-true"``: ``module.double()``) and
  ``model_to_device`` reach the sharded network as a conversion of its dtype (before its
  first forward: the cut is sized in the new dtype) and a placement, which is the
  engine's (ignored: a network too large for the device is never copied onto it whole);
  see ``th.shard``'s ``_apply``.
- ``setup_optimizers``: the optimizers ``configure_optimizers`` built over the sharded
  network's parameters are given to it (``th.shard(network, optimizer)``): each shard
  steps its part on the engine's devices, its state spilled with it. An optimizer over
  other parameters stays Lightning's, plain.
- every ``optimizer.step(closure)`` (Lightning's automatic optimization) runs the closure
  (``training_step``, ``zero_grad``, ``backward``: the shards' ops), then steps the
  shards, and returns the closure's loss.
- gradient clipping (``Trainer(gradient_clip_val=...)``, ``self.clip_gradients``) over
  the sharded optimizer's parameters runs shard by shard, the gradients left on their
  devices, with ``clip_grad_norm_``'s arithmetic over the optimizer's order, or
  ``clip_grad_value_``'s clamp (see :mod:`tune_hydra.frontends.shard_clip`); a precision
  plugin with parameters of its own reads the gradients at home: the shards' state
  comes home first.
- a checkpoint (``fit(ckpt_path=...)``) is restored where plain Lightning restores it:
  the weights before ``setup`` (into the network at home, even one cut by an earlier fit),
  the optimizer's state after it (into the sharded optimizer).

Without this strategy a LightningModule can call ``th.shard(self.model, optimizer)`` in
``configure_optimizers`` itself: the same thing. Lightning is imported on first use of
:class:`HydraStrategy` (``import tune_hydra`` works without it).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tune_hydra.exceptions import MissingDependencyError, NotShardedError, OptimizerMismatchError

if TYPE_CHECKING:
    from lightning.pytorch.strategies import SingleDeviceStrategy


def sharded_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` (itself included) given to ``th.shard``, outermost
    first (a sharded module's own submodules are its shards' business)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside:
            continue
        if "_th_shard" in m.__dict__:
            found.append(m)
            inside.update(id(sub) for sub in nn.Module.modules(m))
    return found


def give_optimizers(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Give each optimizer over a sharded network's parameters to that network (it steps
    shard by shard from then on); one over other parameters stays as it is.

    Raises:
        NotShardedError: ``module`` holds no sharded network.
        OptimizerMismatchError: an optimizer steps parameters of a sharded network and
            others (or of two sharded networks), or two optimizers step one network.
        UnsupportedCallError: an optimizer that cannot step shard by shard (LBFGS).
    """
    from tune_hydra.frontends.shard import attach_optimizer

    networks = sharded_modules(module)
    if not networks:
        raise NotShardedError(
            f"HydraStrategy trains a LightningModule whose network was given to th.shard, "
            f"but no module of this {type(module).__name__} is sharded: write "
            f"self.model = th.shard(Net(...)) where the LightningModule builds it (__init__ "
            f"or configure_model), or drop strategy=HydraStrategy()"
        )
    owned = [{id(p) for p in nn.Module.parameters(net)} for net in networks]
    given: dict[int, int] = {}  # network index -> optimizer index
    for oi, opt in enumerate(optimizers):
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        if not ids:
            continue  # Lightning's stand-in when configure_optimizers returns None
        touching = [ni for ni, own in enumerate(owned) if ids & own]
        if not touching:
            continue  # the LightningModule's other parameters: a plain optimizer
        ni = touching[0]
        if len(touching) > 1 or not ids <= owned[ni]:
            raise OptimizerMismatchError(
                f"optimizer {oi} ({type(opt).__name__}) steps parameters of the sharded "
                f"{type(networks[ni]).__name__} and others: a sharded network's optimizer "
                f"steps only its parameters. Return one optimizer per sharded network (and "
                f"one for the other parameters) from configure_optimizers, or shard the "
                f"module holding them all"
            )
        if ni in given:
            raise OptimizerMismatchError(
                f"optimizers {given[ni]} and {oi} both step the sharded "
                f"{type(networks[ni]).__name__}: a sharded network has one optimizer (put "
                f"the parameters in param groups of one optimizer)"
            )
        given[ni] = oi
        attach_optimizer(networks[ni], opt, replace=True)


def sync_networks(module: nn.Module) -> None:
    """Bring every sharded network's state home for the caller to read and write there
    (gradient clipping over the optimizer's parameters)."""
    for net in sharded_modules(module):
        net._th_sync(write=True)  # type: ignore[operator]


def _strategy_class() -> type[SingleDeviceStrategy]:
    try:
        from lightning.pytorch.strategies import SingleDeviceStrategy
    except ImportError as err:
        raise MissingDependencyError(
            f'HydraStrategy needs Lightning ({err}): pip install "tune_hydra[lightning]"'
        ) from err

    class HydraStrategy(SingleDeviceStrategy):
        """Lightning's single-device strategy for a LightningModule whose network is
        ``th.shard``-ed: the engine trains the network's shards on its devices (see the
        module docstring).

        Args:
            device: where Lightning puts the batches and the LightningModule's other
                parts (the sharded network's outputs come back there). ``None``: the
                Trainer's accelerator's first device (``"cpu"`` for ``accelerator="cpu"``).
            accelerator, checkpoint_io, precision_plugin: as ``SingleDeviceStrategy``'s
                (the Trainer's arguments set them otherwise).
        """

        strategy_name = "tune_hydra"

        def __init__(
            self,
            device: Any = None,
            accelerator: Any = None,
            checkpoint_io: Any = None,
            precision_plugin: Any = None,
        ) -> None:
            super().__init__(
                device="cpu" if device is None else device,
                accelerator=accelerator,
                checkpoint_io=checkpoint_io,
                precision_plugin=precision_plugin,
            )
            self._device_given = device is not None

        def setup_environment(self) -> None:
            if not self._device_given and self.accelerator is not None:
                acc = self.accelerator
                self._root_device = acc.get_parallel_devices(acc.parse_devices(1))[0]
            super().setup_environment()

        def setup(self, trainer: Any) -> None:
            plugin = self.precision_plugin
            if not getattr(plugin.main_params, "_th_synced", False):
                # Clipping reads the optimizer's parameters' gradients (main_params): the
                # shards' state must be home then, as model.parameters() brings it.
                plugin.main_params = _synced(plugin.main_params, self)  # type: ignore[method-assign]
            super().setup(trainer)

        def setup_optimizers(self, trainer: Any) -> None:
            super().setup_optimizers(trainer)
            assert self.lightning_module is not None
            give_optimizers(self.lightning_module, self.optimizers)
            self.optimizers = self.optimizers  # Lightning's wrappers of the sharded ones

    HydraStrategy.__module__ = __name__
    HydraStrategy.__qualname__ = "HydraStrategy"
    return HydraStrategy


def _synced(main_params: Any, strategy: Any) -> Any:
    from tune_hydra.frontends.shard_clip import optimizer_parameters

    def sync() -> None:
        if strategy.lightning_module is not None:
            sync_networks(strategy.lightning_module)

    synced = functools.partial(optimizer_parameters, main_params, sync)
    synced._th_synced = True  # type: ignore[attr-defined]
    return synced


def __getattr__(name: str) -> Any:
    if name == "HydraStrategy":
        cls = _strategy_class()
        globals()[name] = cls  # made once: isinstance and pickle see one class
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HydraStrategy", "give_optimizers", "sharded_modules", "sync_networks"]  # noqa: F822
