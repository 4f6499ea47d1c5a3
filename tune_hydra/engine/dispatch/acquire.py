"""``Engine.acquire``: a lease on a shard's state for a caller's own thread.

It checks the request against the engine (the task's record, its other leases, the
device) and takes the lease from that device's worker; the lease itself is
:mod:`tune_hydra.engine.dispatch.lease`. It sits above the worker, the record and the lease,
which it all reads, so that none of those imports another for its types.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from tune_hydra.exceptions import (
    InvalidOptionError,
    InvalidTaskError,
    LeaseConflictError,
    LeaseEndedError,
    UnknownDeviceError,
)

if TYPE_CHECKING:
    from tune_hydra.engine.dispatch.lease import Lease
    from tune_hydra.engine.dispatch.workers import DeviceWorker
    from tune_hydra.engine.records import TaskRecord
    from tune_hydra.engine.storage.host import HostMemory


def acquire(
    task: str,
    shard: int,
    device: int | str | torch.device,
    *,
    timeout: float | None = None,
    workers: Sequence[DeviceWorker],
    host: HostMemory,
    lock: AbstractContextManager[Any],
    lookup: Callable[[str], TaskRecord | None],
) -> Lease:
    """Lease shard ``shard`` of ``task`` on ``device`` (see ``Engine.acquire``).

    Args:
        task: the task's name.
        shard: the shard's index.
        device: the device's index, its label, or a device only one worker has.
        timeout: seconds to wait for room and for the claim; ``None``: no limit.
        workers: the engine's device workers.
        host: the engine's host memory manager.
        lock: the engine's lock, held while the task's record is read.
        lookup: the task's record, called under ``lock`` (raises for an unknown task);
            ``None`` once the engine is closed.
    """
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise InvalidOptionError(
            "timeout",
            timeout,
            "a number of seconds >= 0, or None (wait as long as needed)",
            "Engine.acquire",
        )
    worker = _worker(workers, device)
    with lock:
        entry = lookup(task)
        if entry is None:
            raise LeaseEndedError(f"shard {shard} of task {task!r}: the engine is closed")
        runner = entry.runner
        n = len(runner.plan.shards)
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < n:
            raise InvalidTaskError(
                f"task {task!r} has {n} shard(s), numbered 0 to {n - 1}; there is no shard "
                f"{shard!r} (see engine.plan({task!r}).shards)"
            )
        if entry.assigned is not None or entry.granted:
            where = f" (an op of it is on device {entry.assigned.label})" if entry.assigned else ""
            raise LeaseConflictError(
                f"task {task!r} is being trained by the engine{where}: its shards cannot be "
                f"leased until its train() futures are done; wait for them (or cancel it)"
            )
        for w in workers:
            if w is not worker and any(le.task == task for le in w.leases()):
                raise LeaseConflictError(
                    f"task {task!r} has a shard leased on device {w.label}; all leases held "
                    f"on one task at once are on one device: release them first, or lease "
                    f"on {w.label}"
                )
        store = runner.store_of(shard)
    deadline = None if timeout is None else time.monotonic() + timeout
    # A device computing in host memory uses the host tensors themselves: busy with the
    # disk tier for the lease's life (a copying device computes on its own copies).
    in_place = host if host.active and not worker.copy else None
    lease = worker.lease(store, deadline=deadline, host=in_place)
    assert lease is not None  # a blocking lease is taken, or raises
    if lease.event is not None:  # the caller computes on its stream: after the copy-in
        torch.cuda.current_stream(worker.device).wait_event(lease.event)
    lease._fence = worker.copy_stream is not None
    return lease


def _worker(workers: Sequence[DeviceWorker], device: Any) -> DeviceWorker:
    """The worker of ``device``: its index, its label (``"cpu#1"``) or a device that only
    one worker has.

    Raises:
        UnknownDeviceError: no such device, or several (emulated CPU devices: use the
            index or the label).
    """
    labels = ", ".join(f"{i} ({w.label})" for i, w in enumerate(workers))
    if isinstance(device, int) and not isinstance(device, bool):
        if 0 <= device < len(workers):
            return workers[device]
        raise UnknownDeviceError(f"no device {device} in this engine; its devices: {labels}")
    if isinstance(device, str):
        for w in workers:
            if w.label == device:
                return w
        try:
            device = torch.device(device)
        except RuntimeError:
            raise UnknownDeviceError(
                f"no device {device!r} in this engine; its devices: {labels}"
            ) from None
    if not isinstance(device, torch.device):
        raise UnknownDeviceError(
            f"a device is an index, a label or a torch.device, not {type(device).__name__}; "
            f"this engine's devices: {labels}"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    found = [w for w in workers if w.device == device]
    if len(found) == 1:
        return found[0]
    if found:
        raise UnknownDeviceError(
            f"device {str(device)!r} is several emulated devices of this engine; give its "
            f"index or label: {labels}"
        )
    raise UnknownDeviceError(f"no device {str(device)!r} in this engine; its devices: {labels}")


__all__ = ["acquire"]
