"""Writes ``checkpoints/``: trial checkpoints as earlier tune_hydra versions wrote them,
kept so that every later version is tested to restore them (tests/frontends/
test_old_checkpoints.py). Written once, by the engine's ``TaskRunner`` of ba6d1dd (which
trained factories then), and not to be rewritten by a later version:

- ``v2_by_name``: format 2 (file digests), optimizer state by parameter name, as
  ``HydraExecutor``'s trials saved it;
- ``v2_per_shard``: format 2, optimizer state and gradients per shard (the older layout);
- ``v1_per_shard``: format 1 (no digests, the config inside the state), per shard.

Each holds ``mlp()`` (tests/conftest.py) trained by Adam for 2 iterations of 3 batches,
2 batches per step (seed 3): saved inside an epoch and inside an accumulation group,
cut into shards by ``device_memory=24_000`` on 2 emulated copying CPU devices.

It calls that runtime (``Engine.add_task``, ``get_state``, ``runner``, ``plan`` and
``checkpoint.EngineTask``), which later versions no longer have, so it runs only in a tree
of 22f1c69 (the commit that added it; its ``TaskRunner`` is ba6d1dd's), where it writes
these folders byte for byte again; no test runs it:

    mkdir /tmp/th-22f1c69 && git archive 22f1c69 | tar -x -C /tmp/th-22f1c69
    cd /tmp/th-22f1c69 && PYTHONPATH=. python tests/frontends/data/make_checkpoints.py
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

import tune_hydra as th
from tests.conftest import make_task, mlp
from tune_hydra.frontends import checkpoint as ck

HERE = Path(__file__).resolve().parent / "checkpoints"
OPTIONS = {"accumulate_steps": 2, "iteration_batches": 3}
CONFIG = {"lr": 0.01}


def main() -> None:
    if not hasattr(ck, "EngineTask"):  # a later tune_hydra: it would only delete the folders
        raise SystemExit(f"run it in a tree of 22f1c69, not this one:\n{__doc__}")
    shutil.rmtree(HERE, ignore_errors=True)
    HERE.mkdir()
    with th.Engine(devices=["cpu", "cpu"], copy_on_cpu=True, device_memory=24_000) as engine:
        engine.add_task("a", make_task(mlp(), "adam"), seed=3, **OPTIONS)
        engine.train("a", 2).result(timeout=120)
        ck.save_trial(
            ck.EngineTask(engine, "a"), HERE / "v2_by_name", trial_id="old", config=CONFIG
        )
        state = engine.get_state("a")
        shards = engine.runner("a").shards
        cut = [list(spec.layer_names) for spec in engine.plan("a").shards]
    model = state.pop("model")
    del state["optimizer"], state["param_grads"]
    state["optimizers"] = [
        None if s.optimizer is None else copy.deepcopy(s.optimizer.state_dict()) for s in shards
    ]
    state["grads"] = [
        [None if p.grad is None else p.grad.clone() for p in s.params] for s in shards
    ]
    ck.write_checkpoint(
        HERE / "v2_per_shard", model, state, trial_id="old", config=CONFIG, shards=cut
    )
    v1 = HERE / "v1_per_shard"
    v1.mkdir()
    torch.save(model, v1 / ck.MODEL_FILE)
    torch.save({**state, "_tune_config": CONFIG}, v1 / ck.STATE_FILE)
    files = {"model": ck.MODEL_FILE, "state": ck.STATE_FILE}
    meta = {"format": 1, "trial_id": "old", "iteration": state["iteration"],
            "epoch": state["epoch"], "files": files}  # fmt: skip
    (v1 / ck.META_FILE).write_text(json.dumps(meta))
    print(f"{len(cut)} shards: {cut}")


if __name__ == "__main__":
    main()
