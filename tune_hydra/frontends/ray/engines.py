"""The engine actors of one :class:`~tune_hydra.HydraExecutor`: one per engine node,
started together, asked together, stopped together.

An engine node is a node with the slot resource (``hydra_slot``); a plain local
``ray.init()`` without it runs one engine on its one node, and its trials reserve a sliver
of CPU instead of a slot (the *fallback*).

This module imports neither torch nor the engine: it runs in the driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tune_hydra.core.policies import AUTO, BasePolicy, resolve_policy
from tune_hydra.exceptions import TuneHydraError
from tune_hydra.frontends.ray.actor import CONTROL_GROUP, EngineActor
from tune_hydra.frontends.ray.errors import EngineStartError
from tune_hydra.frontends.ray.names import engine_actor_name
from tune_hydra.options import EngineOptions, check_positive_int, check_seconds

logger = logging.getLogger(__name__)

DEFAULT_SLOT_RESOURCE = "hydra_slot"
DEFAULT_SLOTS_PER_NODE = 8


def _unwrap(err: BaseException) -> BaseException:
    """The user-facing error inside a RayTaskError / ActorDiedError, if there is one."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return cause
    return err


@dataclasses.dataclass(repr=False, eq=False)  # no repr: it holds the secret
class EngineFleet:
    """The engine actors of one executor (``run_id``), once started.

    Attributes:
        handles: node id -> engine actor handle (empty when not started).
        slots: the number of trial slots over all engine nodes.
        fallback: Ray was started without the slot resource (see the module docstring).
        last_trace, last_summary: what the engines said when they were stopped.
    """

    run_id: str
    secret: str
    factories: Any  # the executor's FactoryStore, handed to every engine actor
    engine_options: EngineOptions
    task_options: dict[str, Any]
    slot_resource: str = DEFAULT_SLOT_RESOURCE
    slots_per_node: int | None = None
    torch_threads: int | None = None
    start_timeout_s: float = 180.0
    factory_timeout_s: float | None = None
    engine_class: str = ""
    handles: dict[str, Any] = dataclasses.field(default_factory=dict)
    slots: int = 0
    fallback: bool = False
    last_trace: list[Any] = dataclasses.field(default_factory=list)
    last_summary: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "HydraExecutor"
        check_positive_int(
            self.slots_per_node,
            "slots_per_node",
            allow_none=True,
            meaning="concurrent trials per node; None: the default",
            where=where,
        )
        check_positive_int(
            self.torch_threads,
            "torch_threads",
            allow_none=True,
            meaning="torch CPU threads in each engine; None: the node's CPUs",
            where=where,
        )
        check_seconds(
            self.start_timeout_s,
            "start_timeout_s",
            meaning="the longest wait for the engine actors to start",
            where=where,
        )

    def start(self) -> None:
        """Start Ray (if needed) and one engine actor per engine node, and wait until
        every engine is built.

        Raises:
            EngineStartError: no engine node, too few GPUs, or the engines did not start.
            TuneHydraError: an engine refused its options.
        """
        if not ray.is_initialized():
            slots = self.slots_per_node or DEFAULT_SLOTS_PER_NODE
            try:
                ray.init(resources={self.slot_resource: slots})
            except ValueError as err:
                # RAY_ADDRESS, or a cluster `ray start`ed on this machine: ray.init()
                # connects to it, and a connecting init takes no resources (the cluster's
                # nodes carry theirs, as `ray start --resources` gave them).
                if "existing cluster" not in str(err):
                    raise
                logger.info("tune_hydra: connecting to the existing Ray cluster")
                ray.init()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        engine_nodes = [n for n in nodes if n["Resources"].get(self.slot_resource, 0) >= 1]
        self.fallback = False
        if not engine_nodes:
            if len(nodes) != 1:
                raise EngineStartError(
                    f"no node of this Ray cluster has the {self.slot_resource!r} resource that "
                    f"marks engine nodes; start each node that should train models with "
                    f"ray start ... --resources='{{\"{self.slot_resource}\": 8}}'"
                )
            # A plain local ray.init(): trials ask for a sliver of CPU instead of a slot.
            self.fallback = True
            engine_nodes = nodes
            warnings.warn(
                f"Ray was started without the {self.slot_resource!r} resource; trials will "
                f"each reserve 0.01 CPU. Call ray.init(resources={{'{self.slot_resource}': 8}}) "
                f"(or let tune_hydra start Ray) to control concurrency with slots.",
                stacklevel=3,
            )
        handles: dict[str, Any] = {}
        slots = 0
        try:
            for node in engine_nodes:
                node_id, res = node["NodeID"], node["Resources"]
                slots += (
                    int(res[self.slot_resource])
                    if not self.fallback
                    else (self.slots_per_node or DEFAULT_SLOTS_PER_NODE)
                )
                handles[node_id] = self.create_actor(node_id, res, len(handles))
        except BaseException:
            self._kill(handles)
            raise
        refs = {node: h.start.remote() for node, h in handles.items()}
        try:
            ray.get(list(refs.values()), timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._kill(handles)
            raise EngineStartError(
                f"the engine actors did not start within {self.start_timeout_s:.0f} s; check "
                f"that the engine nodes have free memory and that tune_hydra is installed there"
            ) from None
        except Exception as err:
            self._kill(handles)
            cause = _unwrap(err)
            if isinstance(cause, TuneHydraError):
                raise cause from None
            raise EngineStartError(f"the engine actors failed to start: {cause}") from err
        self.handles, self.slots = handles, slots

    def create_actor(self, node_id: str, res: dict[str, float], index: int) -> Any:
        """Create the engine actor of node ``node_id`` (resources ``res``), the
        ``index``-th engine; ``devices="auto"`` becomes the node's GPUs, or its CPU."""
        devices = self.engine_options.devices
        if isinstance(devices, str) and devices == "auto":
            num_gpus = int(res.get("GPU", 0))
            if num_gpus == 0:
                warnings.warn(
                    f"devices='auto': node {node_id[:8]} has no GPU; its engine trains on the CPU",
                    stacklevel=4,
                )
                devices = "cpu"  # say it here once rather than in every actor's log
        else:
            names = [devices] if isinstance(devices, str) else list(devices)
            num_gpus = sum(1 for d in names if str(d).startswith("cuda"))
        if num_gpus > int(res.get("GPU", 0)):
            raise EngineStartError(
                f"devices={self.engine_options.devices!r} asks for {num_gpus} GPU(s), but node "
                f"{node_id[:8]} has {int(res.get('GPU', 0))}: use devices='auto' (its GPUs, or "
                f"its CPU), devices='cpu', or run on a node with GPUs"
            )
        threads = self.torch_threads or max(1, int(res.get("CPU", 1)))
        cls = ray.remote(concurrency_groups={CONTROL_GROUP: 32})(EngineActor)  # type: ignore[call-overload]
        return cls.options(
            name=engine_actor_name(self.run_id, node_id),
            # No CPU: an engine that reserved its node's CPUs starved Tune's trials (hang).
            num_cpus=0,
            num_gpus=num_gpus,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(
            dataclasses.replace(self.engine_options, devices=devices),
            self.task_options,
            self.engine_class,
            threads,
            f"node{index}" if index or len(ray.nodes()) > 1 else "",
            self.factories,
            self.secret,
            self.factory_timeout_s,
        )

    @staticmethod
    def _kill(handles: dict[str, Any]) -> None:
        for handle in handles.values():
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)

    def ask(self, method: str, *args: Any) -> dict[str, Any]:
        """Node id -> what ``method(secret, *args)`` of its engine actor returns."""
        refs = {
            node: getattr(h, method).remote(self.secret, *args) for node, h in self.handles.items()
        }
        return {node: ray.get(ref, timeout=60) for node, ref in refs.items()}

    def trace_events(self) -> list[Any]:
        """Every engine's trace events (live while started, else the last collected)."""
        if not self.handles:
            return list(self.last_trace)
        return [e for events in self.ask("trace").values() for e in events]

    def summary(self) -> dict[str, Any]:
        """Node id -> the engine's summary (live while started, else the last collected)."""
        return self.ask("summary") if self.handles else dict(self.last_summary)

    def choose_policy(self, policy: str | BasePolicy, *, search_aware: bool) -> None:
        """Resolve the executor's ``policy`` when it is ``"auto"`` (one log line says
        which and why): the milestone policy for a ``search_aware`` run, else LRTF. The
        engines are built with the choice unless they are up already."""
        if isinstance(policy, str) and policy == AUTO:
            chosen = resolve_policy(AUTO, search_aware=search_aware)
            if not self.handles:
                self.engine_options = dataclasses.replace(self.engine_options, policy=chosen.name)

    def release_factory(self, factory_id: str) -> None:
        """Every engine forgets the factory (a dead engine holds nothing)."""
        refs = []
        for handle in self.handles.values():
            with contextlib.suppress(Exception):
                refs.append(handle.release_factory.remote(self.secret, factory_id))
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=30)

    def stop(self) -> None:
        """Collect the engines' trace and summary, close the engines and kill their actors."""
        try:
            self.last_trace = self.trace_events()
            self.last_summary = self.summary()
        except Exception:
            logger.warning("tune_hydra: could not collect the engines' trace", exc_info=True)
        with contextlib.suppress(Exception):
            ray.get([h.close.remote(self.secret) for h in self.handles.values()], timeout=30)
        self._kill(self.handles)
        self.handles = {}


__all__ = ["DEFAULT_SLOTS_PER_NODE", "DEFAULT_SLOT_RESOURCE", "EngineFleet"]
