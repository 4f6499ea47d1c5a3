"""Gradient clipping on a sharded model: what it costs in copies and time.

Two ways users clip, each on 2 emulated copying CPU devices (``copy_on_cpu=True``,
``max_layers_per_shard=2``: few shards resident, most evicted after their backward), one
trial, clipping on and off, the runs interleaved in rounds:

- **Lightning**: ``lightning.Trainer(gradient_clip_val=1.0, strategy=th.HydraStrategy())``
  (by norm; ``--value``: ``gradient_clip_algorithm="value"``) over a LightningModule whose
  MLP (8 x 256 wide) is ``th.shard``-ed, Adam, one epoch of 32 batches of 64;
- **Trainer**: Hugging Face ``Trainer`` (``max_grad_norm=1.0``, its default, or 0) over a
  ``th.shard``-ed GPT-2 built with ``from_config`` (4 layers, 128 wide), 16 steps of 2
  micro-batches of 2.

For each: the bytes copied to and from the devices (the engine's trace: ``copy_in`` +
``copy_out``), the syncs that brought the state home (``LoopRunner.sync`` calls that
found it away), and the median wall time. Clipping that runs shard by shard on the
gradients where the backward left them copies about what a run without clipping copies;
one that brings the state home (a sync per step) or copies each shard in again for its
norms copies more.

Run::

    python benchmarks/clipping.py            # about a minute on 2 cores
    python benchmarks/clipping.py --quick    # seconds (used by the tests)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import tune_hydra as th


@dataclass
class Config:
    """Benchmark sizes."""

    batches: int = 32
    width: int = 256
    steps: int = 16
    rounds: int = 3


QUICK = Config(batches=4, width=32, steps=2, rounds=1)


@contextlib.contextmanager
def counted_syncs() -> Iterator[list[int]]:
    """Counts the syncs that found a loop's state away from home."""
    from tune_hydra.engine.runtime.loop import LoopRunner

    syncs: list[int] = []
    sync = LoopRunner.sync

    def counting(self: LoopRunner) -> None:
        if not self.at_home:
            syncs.append(1)
        sync(self)

    LoopRunner.sync = counting  # type: ignore[method-assign]
    try:
        yield syncs
    finally:
        LoopRunner.sync = sync  # type: ignore[method-assign]


def engine() -> th.Engine:
    return th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, max_layers_per_shard=2)


def copied(eng: th.Engine) -> int:
    return sum(e.bytes_moved for e in eng.trace.events if e.op in ("copy_in", "copy_out"))


def lightning_fit(cfg: Config, clip: float | None, algorithm: str) -> tuple[float, int]:
    """One Lightning fit; returns (seconds, bytes copied)."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Lit(pl.LightningModule):
        def __init__(self, eng: th.Engine) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for _ in range(8):
                layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
            self.network = th.shard(nn.Sequential(*layers, nn.Linear(cfg.width, 10)), engine=eng)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.network(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.network.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    n = 64 * cfg.batches
    data = TensorDataset(
        torch.randn(n, cfg.width, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    with engine() as eng:
        model = Lit(eng)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            gradient_clip_val=clip,
            gradient_clip_algorithm=algorithm,
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            strategy=th.HydraStrategy(),
        )
        t0 = time.perf_counter()
        trainer.fit(model, DataLoader(data, batch_size=64))
        seconds = time.perf_counter() - t0
        moved = copied(eng)
        th.unshard(model.network)
    return seconds, moved


def hf_trainer(cfg: Config, norm: float) -> tuple[float, int]:
    """One Hugging Face Trainer run; returns (seconds, bytes copied)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=1000, n_positions=64
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (4 * cfg.steps, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in ids]
    with engine() as eng, tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=cfg.steps,
            max_grad_norm=norm,
            report_to=[],
            save_strategy="no",
            logging_steps=10_000,
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=th.shard(model, engine=eng), args=args, train_dataset=data
        )
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # its end-of-run summary
            trainer.train()
        seconds = time.perf_counter() - t0
        moved = copied(eng)
        th.unshard(trainer.model)
    return seconds, moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seconds (the tests)")
    parser.add_argument("--value", action="store_true", help="Lightning clips by value")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    algorithm = "value" if args.value else "norm"
    ways: dict[str, Callable[[], tuple[float, int]]] = {}
    with contextlib.suppress(ImportError):
        import lightning.pytorch  # noqa: F401

        clip = 0.01 if args.value else 1.0
        ways[f"Lightning, clip by {algorithm}"] = lambda: lightning_fit(cfg, clip, algorithm)
        ways["Lightning, no clipping"] = lambda: lightning_fit(cfg, None, algorithm)
    with contextlib.suppress(ImportError):
        import transformers  # noqa: F401

        ways["Trainer, max_grad_norm=1.0"] = lambda: hf_trainer(cfg, 1.0)
        ways["Trainer, max_grad_norm=0"] = lambda: hf_trainer(cfg, 0.0)
    seen: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ways}
    for _ in range(cfg.rounds):
        for name, way in ways.items():
            with counted_syncs() as syncs:
                seconds, moved = way()
            seen[name].append((seconds, moved, len(syncs)))
    print(
        f"clipping: 2 emulated copying CPU devices, max_layers_per_shard=2, 1 torch thread; "
        f"{cfg.rounds} interleaved round(s)"
    )
    print(f"{'way':32} {'median s':>9} {'MiB copied':>11} {'syncs':>6}")
    for name, runs in seen.items():
        wall = statistics.median(r[0] for r in runs)
        mib = statistics.median(r[1] for r in runs) / 2**20
        syncs = statistics.median(r[2] for r in runs)
        print(f"{name:32} {wall:9.3f} {mib:11.0f} {syncs:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
