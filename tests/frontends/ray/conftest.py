"""One shared local Ray session for the Tune integration tests.

Ray runs in a temporary directory with auth disabled (Ray 2.60 would otherwise write
``~/.ray/auth_token``), 2 CPUs and 8 ``hydra_slot`` slots, and is shut down at the end. The
multi-node test needs a ``ray.cluster_utils.Cluster`` instead: its fixture stops the shared
session first and the next test that asks for ``ray_session`` starts it again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402

from tests.frontends.ray import tune_tasks  # noqa: E402

# The engine actors unpickle the test factories; they cannot import the test package.
cloudpickle.register_pickle_by_value(tune_tasks)

SLOTS = 8


class _Session:
    """Starts the shared local Ray on demand; remembers its temp dir."""

    def __init__(self) -> None:
        self.tmp: str | None = None
        self.active = False

    def ensure(self) -> None:
        if self.active and ray.is_initialized():
            return
        if ray.is_initialized():
            ray.shutdown()
        # Short path: Ray's unix sockets live under it (107-byte limit).
        self.tmp = self.tmp or tempfile.mkdtemp(prefix="thray", dir="/tmp")
        ray.init(
            num_cpus=2,
            resources={"hydra_slot": SLOTS},
            _temp_dir=self.tmp,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )
        self.active = True

    def stop(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        self.active = False

    def close(self) -> None:
        self.stop()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


_SESSION = _Session()


@pytest.fixture(scope="session")
def _ray_session_owner() -> Iterator[_Session]:
    yield _SESSION
    _SESSION.close()


@pytest.fixture
def ray_session(_ray_session_owner: _Session) -> _Session:
    """The shared local Ray (2 CPUs, 8 hydra slots), started if needed."""
    _ray_session_owner.ensure()
    return _ray_session_owner


@pytest.fixture(scope="module")
def shared_executor(request: Any, _ray_session_owner: _Session) -> Iterator[Any]:
    """One started executor for the tests of a module that are not about the engine's
    lifecycle or options (issue 31: an engine actor start is ~2.7 s and ~3 core-s of the
    Ray tier's CPU): the module's ``make_shared_executor()``, else
    ``HydraExecutor(devices="cpu", device_memory="18KiB")``. Those tests check that their
    trials left nothing registered, so a leak shows in the test that made it."""
    from tune_hydra.frontends.ray import HydraExecutor

    make = getattr(request.module, "make_shared_executor", None)
    _ray_session_owner.ensure()
    with make() if make else HydraExecutor(devices="cpu", device_memory="18KiB") as ex:
        yield ex


@pytest.fixture
def ray_cluster(_ray_session_owner: _Session) -> Iterator[Any]:
    """A 2-node ``ray.cluster_utils.Cluster`` (1 CPU and 4 slots per node), connected."""
    from ray.cluster_utils import Cluster

    _ray_session_owner.stop()
    tmp = tempfile.mkdtemp(prefix="thclu", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp  # the cluster's session files (and address file) go here
    head = {"num_cpus": 1, "resources": {"hydra_slot": 4}, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        cluster.add_node(num_cpus=1, resources={"hydra_slot": 4})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def storage(tmp_path: Any) -> str:
    """A fresh Tune storage_path."""
    path = tmp_path / "ray_results"
    path.mkdir()
    return str(path)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Run the tests that need their own multi-node cluster last, so the shared local Ray
    session starts only once."""
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))
