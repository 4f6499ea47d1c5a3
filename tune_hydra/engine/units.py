"""Device lists and capacities (torch's side of the engine options).

A budget's parsing and a device list's spelling are checked without torch, in
:mod:`tune_hydra.options` (``parse_bytes`` is re-exported here, where it was first);
here the devices are resolved against the machine.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from tune_hydra.exceptions import UnknownDeviceError
from tune_hydra.options import check_devices, parse_bytes

__all__ = ["device_capacity", "parse_bytes", "resolve_devices"]


def resolve_devices(devices: str | Sequence[str | torch.device] | None) -> list[torch.device]:
    """Turn ``"auto"``, ``"cpu"``, ``["cuda:0", "cuda:1"]`` ... into a checked device list.

    ``"cpu"`` may appear several times: each entry is one emulated device with its own
    worker. ``"auto"`` means every visible CUDA device, or one CPU device (with a warning)
    when there is none.

    Raises:
        UnknownDeviceError: a spelling :func:`~tune_hydra.options.check_devices` refuses,
            or a CUDA device this machine does not have.
    """
    check_devices(devices)
    if devices is None or (isinstance(devices, str) and devices == "auto"):
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        warnings.warn("devices='auto' found no CUDA device; training on the CPU", stacklevel=3)
        return [torch.device("cpu")]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    out = []
    for dev in devices:
        d = torch.device(dev)  # its spelling is checked: cpu or cuda, with an index or not
        if d.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = 0 if d.index is None else d.index
            if index >= count:
                raise UnknownDeviceError(
                    f"device {dev!r} is not available: this machine has {count} CUDA device(s); "
                    f"use 'auto' or 'cpu'"
                )
            d = torch.device("cuda", index)
        out.append(d)
    return out


def device_capacity(device: torch.device) -> int:
    """Total memory of a device in bytes (for CPU, the machine's physical memory)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        import os

        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


#: The share of a GPU's memory the engine budgets when no ``device_memory`` is given
#: (the rest: the CUDA context, the allocator's fragmentation, other processes).
GPU_SHARE = 0.9


def device_budget(device: torch.device, budget: int | None) -> int | None:
    """A device's budget: ``device_memory`` (``budget``), else :data:`GPU_SHARE` of a GPU
    (``None`` on the CPU: no limit). The one place of that default: the engine's workers
    and a ``th.shard`` loop's cut use it."""
    if budget is None and device.type == "cuda":
        return int(device_capacity(device) * GPU_SHARE)
    return budget
