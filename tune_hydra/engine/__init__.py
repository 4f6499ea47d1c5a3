"""The shard engine: partition, spill, execute and multiplex. Never imports Ray."""

from __future__ import annotations

from tune_hydra.core.ops import Op, OpKind
from tune_hydra.core.policies import (
    BasePolicy,
    Candidate,
    FIFOPolicy,
    LRTFPolicy,
    RoundRobinPolicy,
    get_policy,
)
from tune_hydra.core.trace import Trace, TraceEvent, plot_timeline, save_trace
from tune_hydra.engine.engine import Engine
from tune_hydra.engine.reference import train_plain
from tune_hydra.engine.registration.partition import LayerCost, ShardPlan, ShardSpec, plan_shards
from tune_hydra.engine.storage import ShardStore
from tune_hydra.engine.task import ModelTask, model_layers
from tune_hydra.engine.units import parse_bytes, resolve_devices

__all__ = [
    "BasePolicy",
    "Candidate",
    "Engine",
    "FIFOPolicy",
    "LRTFPolicy",
    "LayerCost",
    "ModelTask",
    "Op",
    "OpKind",
    "RoundRobinPolicy",
    "ShardPlan",
    "ShardSpec",
    "ShardStore",
    "Trace",
    "TraceEvent",
    "get_policy",
    "model_layers",
    "parse_bytes",
    "plan_shards",
    "plot_timeline",
    "resolve_devices",
    "save_trace",
    "train_plain",
]
