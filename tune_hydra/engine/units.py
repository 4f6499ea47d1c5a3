"""Parsing of memory budgets and device lists."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import torch

from tune_hydra.exceptions import BudgetFormatError, UnknownDeviceError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str | None, *, option: str = "device_memory") -> int | None:
    """Turn a budget such as ``"512MiB"``, ``"8GiB"``, ``"1.5GB"`` or ``4096`` into bytes.

    ``None`` stays ``None`` (meaning: no limit, such as the whole device).

    Args:
        value: the budget given.
        option: its name in the messages (``"device_memory"``, ``"host_memory"``).

    Raises:
        BudgetFormatError: not a positive int or a number with a known unit.

    Example:
        >>> parse_bytes("1.5KiB")
        1536
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise BudgetFormatError(f"{option} must be bytes or a string like '8GiB', not {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise BudgetFormatError(f"{option} must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            # device_memory keeps its historical wording; other budgets are named.
            what = "the memory budget" if option == "device_memory" else f"the {option} budget"
            raise BudgetFormatError(
                f"cannot parse {what} {value!r}; write a number of bytes or a number "
                f"with a unit such as '512MiB', '8GiB' or '1.5GB'"
            )
        nbytes = int(float(match.group(1)) * _UNITS[unit])
        if nbytes <= 0:
            raise BudgetFormatError(f"{option} must be positive, got {value!r}")
        return nbytes
    raise BudgetFormatError(
        f"{option} must be an int (bytes), a string like '8GiB', or None; got "
        f"{type(value).__name__}"
    )


def resolve_devices(devices: str | Sequence[str | torch.device] | None) -> list[torch.device]:
    """Turn ``"auto"``, ``"cpu"``, ``["cuda:0", "cuda:1"]`` ... into a checked device list.

    ``"cpu"`` may appear several times: each entry is one emulated device with its own
    worker. ``"auto"`` means every visible CUDA device, or one CPU device (with a warning)
    when there is none.
    """
    if devices is None or (isinstance(devices, str) and devices == "auto"):
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        warnings.warn("devices='auto' found no CUDA device; training on the CPU", stacklevel=3)
        return [torch.device("cpu")]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    if len(devices) == 0:
        raise UnknownDeviceError(
            "devices is empty; pass 'auto', 'cpu', or a list such as ['cuda:0', 'cuda:1']"
        )
    out = []
    for dev in devices:
        try:
            d = torch.device(dev)
        except (RuntimeError, TypeError) as err:
            raise UnknownDeviceError(
                f"unknown device {dev!r}; use 'cpu', 'cuda', 'cuda:N' or 'auto'"
            ) from err
        if d.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = 0 if d.index is None else d.index
            if index >= count:
                raise UnknownDeviceError(
                    f"device {dev!r} is not available: this machine has {count} CUDA device(s); "
                    f"use 'auto' or 'cpu'"
                )
            d = torch.device("cuda", index)
        elif d.type != "cpu":
            raise UnknownDeviceError(
                f"device {dev!r} is not supported; use 'cpu', 'cuda:N' or 'auto'"
            )
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
