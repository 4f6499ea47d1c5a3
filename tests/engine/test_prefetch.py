"""Double buffering: the next shard is promoted while another computes, within budget."""

from __future__ import annotations

import json

import torch
from torch import nn

import tune_hydra as th


def _task(seed: int) -> th.ModelTask:
    torch.manual_seed(seed)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())])
    data = [(torch.randn(256, 256), torch.randn(256, 256)) for _ in range(3)]
    return th.ModelTask(model, nn.MSELoss(), lambda p: torch.optim.Adam(p, lr=1e-3), data)


def _run(prefetch: bool) -> th.History:
    tasks = {f"t{i}": _task(i) for i in range(3)}
    return th.train_models(
        tasks,
        devices=["cpu"],
        device_memory="4MiB",
        epochs=1,
        seed=0,
        prefetch=prefetch,
        copy_on_cpu=True,
    )


def test_copies_overlap_other_tasks_compute_and_memory_stays_in_budget() -> None:
    h = _run(prefetch=True)
    events = h.trace.events
    compute = [e for e in events if e.op in ("F", "L", "B", "S", "E")]
    copies = [e for e in events if e.op == "copy_in"]
    assert copies and all(e.bytes_moved > 0 for e in copies)
    overlapped = sum(
        any(c.task != e.task and c.start < e.end and e.start < c.end for e in compute)
        for c in copies
    )
    assert overlapped >= len(copies) // 2, (overlapped, len(copies))
    h.trace.validate()
    spilled = sum(e.bytes_moved for e in copies if e.task == "t0")
    assert h["t0"][0]["bytes_spilled"] >= spilled > 0  # copy_in traced; copy_out counted too
    plan = h.plans["t0"]
    assert len(plan) >= 3
    peak_state = h.summary["devices"]["cpu"]["peak_resident_bytes"]
    assert peak_state + max(s.activation_bytes for s in plan.shards) <= plan.budget


def test_without_prefetch_one_shard_resident_and_no_overlap() -> None:
    h = _run(prefetch=False)
    compute = [e for e in h.trace.events if e.op in ("F", "L", "B", "S", "E")]
    copies = [e for e in h.trace.events if e.op == "copy_in"]
    assert not any(c.start < e.end and e.start < c.end for c in copies for e in compute)
    biggest = max(s.state_bytes for s in h.plans["t0"].shards)
    assert h.summary["devices"]["cpu"]["peak_resident_bytes"] <= biggest


def test_trace_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    h = _run(prefetch=True)
    path = th.save_trace(h.trace, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    names = [e["name"] for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert len(names) == len(h.trace) and any(n.startswith("t1:B") for n in names)
    png = th.plot_timeline(h.trace, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 0 < h.trace.utilization()["cpu"] <= 1.0
    assert "t0" in h.trace.table(limit=5) or "t1" in h.trace.table(limit=5)
