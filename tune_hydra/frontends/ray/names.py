"""The names Ray knows tune_hydra's actors by.

Its own module, importing nothing: the trial processes (the proxies) find their node's
engine actor by name without importing the actor's module, and the actor, the executor
and the proxies agree on one spelling.
"""

from __future__ import annotations

ENGINE_ACTOR_PREFIX = "tune_hydra_engine"


def engine_actor_name(run_id: str, node_id: str) -> str:
    """The Ray name of the engine actor of executor ``run_id`` on node ``node_id``.

    Example:
        >>> engine_actor_name("run1", "node7")
        'tune_hydra_engine:run1:node7'
    """
    return f"{ENGINE_ACTOR_PREFIX}:{run_id}:{node_id}"
