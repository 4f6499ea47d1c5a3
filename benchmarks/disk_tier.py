"""The disk tier: 8 tasks whose states sum to 4x ``host_memory`` vs unlimited host memory.

Eight MLPs (``--depth`` x Linear(``--width``) + ReLU and a classifier head, Adam, one
learning rate each) are trained one epoch each, all at once, by one ``Engine`` on
emulated copying devices (``devices=["cpu", "cpu"]``, ``copy_on_cpu=True``: every visit
copies a shard's state in and out, as on a GPU), with a ``device_memory`` that cuts each
model into >= 4 shards, twice in one run:

- **(a) disk**: ``host_memory`` = 1/4 of the tasks' training states (parameters,
  gradients, Adam moments, as the partitioner counts them), ``spill_dir`` a fresh folder
  (``--spill-dir``; default a temporary folder under the current directory, i.e. on its
  file system, not tmpfs);
- **(b) RAM**: the same with ``host_memory=None`` (nothing goes to disk).

Each configuration runs in its own subprocess (so one's memory does not pollute the
other's RSS): data built, baseline RSS read, then the engine started, the models built
and cut (each task a ``TaskLoop``, registered by its ``cut()``) one by one, all trained,
and the weights saved (``torch.save``) for the parent to compare. Reported:

- **throughput**: samples/s of the training (from the loops' ``start`` calls to the last
  result), and (a)/(b);
- **disk bytes/s** of (a): ``summary()["host"]`` written and read bytes over that wall
  time, against the machine's sequential bandwidth measured in the same run in
  ``spill_dir`` (a ``--bw-mib`` file written with ``os.write`` in 8 MiB chunks and
  ``fsync``, read back after ``POSIX_FADV_DONTNEED``, then read again from the page
  cache), and what the block device itself saw during training (its
  ``/sys/dev/block/*/stat`` sector counters: the engine does not ``fsync`` scratch files,
  so with free RAM the kernel's page cache absorbs writes and serves reads);
- **peak RSS** of (a) during the engine's life up to the end of training (VmRSS sampled
  every 10 ms, and the kernel's VmHWM reset at the baseline) minus the baseline, against
  ``host_memory`` + devices x ``device_memory`` (emulated devices hold their shards in
  host RAM too). glibc keeps freed blocks below its dynamic mmap threshold (which rises
  to the largest block freed, up to 32 MiB) in its heaps, so RSS also holds memory the
  engine has freed; ``--fixed-mmap-threshold`` runs both configurations with
  ``MALLOC_MMAP_THRESHOLD_=131072`` (every tensor unmapped when freed: slower, but RSS
  then shows what is live);
- **disk wait**: ``summary()["host"]["disk_wait_s"]``;
- **trace**: ``engine.trace.validate(host_budget=host_memory)`` (the replayed host
  ledger never over budget) and ``trace.summary()["disk"]``;
- **parity**: every task's final weights equal in (a) and (b), bit for bit.

Exit status 1 if parity is not exact, the trace check fails, or a run fails.

Run::

    python benchmarks/disk_tier.py                      # about a minute
    python benchmarks/disk_tier.py --spill-dir /nvme/x  # another file system
    python benchmarks/disk_tier.py --fixed-mmap-threshold  # RSS without malloc's cache
    python benchmarks/disk_tier.py --quick              # a few seconds (tests)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import make_data, make_mlp  # benchmarks/common.py
from torch import nn

import tune_hydra as th
from tune_hydra.engine import Engine
from tune_hydra.engine.registration.partition import layer_costs, plan_shards
from tune_hydra.engine.task import model_layers
from tune_hydra.frontends.task_loop import TaskLoop

MiB = 2**20
LRS = (1e-3, 7e-4, 5e-4, 3e-4, 2e-4, 1e-4, 7e-5, 5e-5)


@dataclass
class Config:
    """Benchmark sizes."""

    width: int = 512
    depth: int = 8
    batch: int = 128
    batches: int = 16
    tasks: int = 8
    devices: int = 2
    min_shards: int = 4
    host_frac: float = 0.25
    bw_mib: int = 512


QUICK = Config(width=64, depth=4, batch=16, batches=3, bw_mib=16)


def _adam(lr: float) -> Any:
    return lambda params: torch.optim.Adam(params, lr=lr)


# -- sizing -------------------------------------------------------------------------------


def sizes(cfg: Config) -> dict[str, int]:
    """Per-task state, the device budget cutting each model into >= ``min_shards`` (the
    largest that does), the host budget, and the largest shard's state."""
    torch.manual_seed(0)
    model = make_mlp(cfg.width, cfg.depth)
    sample = make_data(cfg.width, cfg.batch, 1)[0][0]
    costs = layer_costs(model_layers(model), _adam(1e-3), sample)
    state = sum(c.state_bytes for c in costs)
    top = sum(c.total_bytes for c in costs) + max(c.state_bytes for c in costs)
    for k in range(64, 0, -1):
        budget = top * k // 64
        plan = plan_shards(costs, budget)
        if len(plan) >= cfg.min_shards:
            break
    else:
        raise ValueError(f"no budget cuts the model into {cfg.min_shards} shards")
    return {
        "task_state": state,
        "total_state": state * cfg.tasks,
        "device_memory": budget,
        "shards": len(plan),
        "max_shard_state": max(s.state_bytes for s in plan.shards),
        "host_memory": int(state * cfg.tasks * cfg.host_frac),
    }


# -- the machine ----------------------------------------------------------------------------


def file_system(path: str) -> dict[str, Any]:
    """Mount point, source and type of the file system holding ``path``, and its free
    bytes (``statvfs``)."""
    real = os.path.realpath(path)
    best = ("/", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            source, point, fstype = line.split()[:3]
            point = point.replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, source, fstype)
    st = os.statvfs(real)
    return {
        "mount": best[0],
        "source": best[1],
        "fstype": best[2],
        "free_bytes": st.f_bavail * st.f_frsize,
        "in_ram": best[2] in ("tmpfs", "ramfs"),
    }


def block_stat_path(path: str) -> str | None:
    """``/sys/dev/block/MAJ:MIN/stat`` of the block device holding ``path`` (its
    partition's counters), or ``None`` (tmpfs, overlay, no sysfs)."""
    dev = os.stat(path).st_dev
    stat = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return stat if os.path.exists(stat) else None


def block_bytes(stat: str | None) -> tuple[int, int] | None:
    """``(bytes read, bytes written)`` so far by the block device (512-byte sectors)."""
    if stat is None:
        return None
    fields = Path(stat).read_text().split()
    return int(fields[2]) * 512, int(fields[6]) * 512


def bandwidth(folder: str, mib: int, chunk_mib: int = 8) -> dict[str, float]:
    """Sequential bytes/s in ``folder``: write ``mib`` MiB in ``chunk_mib`` chunks and
    ``fsync``; read it back after asking the kernel to drop its cached pages; read it
    again (from the page cache)."""
    chunk = os.urandom(chunk_mib * MiB)  # random: no compression or dedup helps
    n = max(1, mib // chunk_mib)
    path = os.path.join(folder, "bandwidth.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        write_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    total = n * len(chunk)
    buf = bytearray(len(chunk))

    def read_all() -> float:
        fd = os.open(path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            while os.readv(fd, [buf]) > 0:
                pass
            return time.perf_counter() - t0
        finally:
            os.close(fd)

    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages (fsynced): dropped
        os.close(fd)
        read_s = read_all()
        cached_s = read_all()
    finally:
        os.unlink(path)
    return {
        "bytes": total,
        "write_Bps": total / write_s,
        "read_Bps": total / read_s,
        "cached_read_Bps": total / cached_s,
    }


# -- RSS --------------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """This process's ``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ``RssShmem`` (bytes)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_hwm() -> bool:
    """Reset the kernel's peak RSS (``VmHWM``) of this process to its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler(threading.Thread):
    """Samples ``/proc/self/status`` every ``period`` s; keeps the peak of each field."""

    def __init__(self, period: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for key, value in proc_status().items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            self.samples += 1
            self._halt.wait(self.period)

    def stop(self) -> dict[str, int]:
        self._halt.set()
        self.join()
        return self.peak


# -- one configuration (a subprocess) ---------------------------------------------------------


def trace_check(engine: Engine, host_budget: int | None) -> str:
    """``"ok"`` if the trace validates (with the host ledger's replay under a budget)."""
    try:
        if host_budget is None:
            engine.trace.validate()
        else:
            engine.trace.validate(host_budget=host_budget)  # type: ignore[call-arg]
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def warm_up(cfg: Config, spill_dir: str | None) -> None:
    """Four tiny tasks through an engine like the run's (spilling to ``spill_dir`` if
    given): the first training maps code pages and builds torch's lazy state, which
    should count neither in the run's RSS nor in its time."""
    with Engine(
        devices=["cpu"] * cfg.devices,
        copy_on_cpu=True,
        host_memory=64 * 1024 if spill_dir else None,  # < the 4 tasks' ~160 KiB
        spill_dir=spill_dir,
    ) as engine:
        loops = []
        for i in range(4):
            task = th.ModelTask(
                make_mlp(32, 2), nn.CrossEntropyLoss(), _adam(1e-3), make_data(32, 4, 2, i)
            )
            loops.append(TaskLoop(f"w{i}", task, engine, seed=i))
        for future in [loop.start(1) for loop in loops]:
            future.result(timeout=600)
        for loop in loops:
            loop.close()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the tasks in one engine; figures (weights saved to ``spec["weights"]``)."""
    cfg = Config(**spec["config"])
    host_memory, spill_dir = spec["host_memory"], spec["spill_dir"]
    data = [make_data(cfg.width, cfg.batch, cfg.batches, seed=i) for i in range(cfg.tasks)]
    stat = block_stat_path(spill_dir or os.getcwd())
    warm_up(cfg, spill_dir)
    gc.collect()
    baseline = proc_status()
    hwm_reset = reset_hwm()
    sampler = RssSampler()
    sampler.start()
    engine = Engine(
        devices=["cpu"] * cfg.devices,
        device_memory=spec["device_memory"],
        copy_on_cpu=True,
        host_memory=host_memory,
        spill_dir=spill_dir,
    )
    models: dict[str, nn.Module] = {}
    loops: list[TaskLoop] = []
    try:
        t_setup = time.perf_counter()
        for i in range(cfg.tasks):
            # Built and cut (registered) one at a time, so only the engine decides where
            # earlier ones' states live; the same initial weights in every configuration.
            torch.manual_seed(i)
            models[f"t{i}"] = make_mlp(cfg.width, cfg.depth)
            task = th.ModelTask(models[f"t{i}"], nn.CrossEntropyLoss(), _adam(LRS[i]), data[i])
            loops.append(TaskLoop(f"t{i}", task, engine, seed=i))
            loops[-1].cut()
        names = list(models)
        setup_s = time.perf_counter() - t_setup
        disk0 = block_bytes(stat)
        t0 = time.perf_counter()
        futures = [loop.start(1) for loop in loops]
        results = {name: f.result(timeout=3600) for name, f in zip(names, futures, strict=True)}
        wall = time.perf_counter() - t0
        disk1 = block_bytes(stat)
        peak = sampler.stop()
        hwm = proc_status()["VmHWM"] if hwm_reset else None
        summary = engine.summary()
        trace = engine.trace.summary()
        out: dict[str, Any] = {
            "wall_s": wall,
            "setup_s": setup_s,
            "samples": cfg.tasks * cfg.batches * cfg.batch,
            "losses": {n: r[-1]["loss"] for n, r in results.items()},
            "baseline": baseline,
            "peak": peak,
            "hwm": hwm,
            "rss_samples": sampler.samples,
            "host": summary.get("host"),
            "trace_disk": trace.get("disk"),
            "trace_check": trace_check(engine, host_memory),
            "utilization": {d: v["utilization"] for d, v in summary["devices"].items()},
            "shards": {n: v["num_shards"] for n, v in summary["tasks"].items()},
            "block_read": None if disk0 is None or disk1 is None else disk1[0] - disk0[0],
            "block_written": None if disk0 is None or disk1 is None else disk1[1] - disk0[1],
        }
    finally:
        if sampler.is_alive():
            sampler.stop()
        for loop in loops:
            loop.close()  # its model back on the CPU, in RAM (read back from disk too)
        engine.close()
    torch.save({n: m.state_dict() for n, m in models.items()}, spec["weights"])
    return out


def run_child(spec: dict[str, Any], timeout: float, fixed_mmap: bool) -> dict[str, Any]:
    """Run :func:`child` in a fresh interpreter; its figures, or ``{"error": ...}``.

    With ``fixed_mmap``, glibc's mmap threshold is fixed at 128 KiB (its dynamic
    threshold rises to the largest freed block, up to 32 MiB, after which freed tensors
    stay in malloc's heaps and keep counting in RSS)."""
    env = dict(os.environ)
    if fixed_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    here = str(Path(__file__).resolve().parent)
    root = str(Path(here).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr).strip()[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent ------------------------------------------------------------------------------


def compare(path_a: str, path_b: str) -> tuple[bool, str]:
    """Whether every task's weights are equal bit for bit; a line saying so."""
    a = torch.load(path_a, weights_only=True)
    b = torch.load(path_b, weights_only=True)
    diffs = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b or set(a[name]) != set(b[name]):
            diffs.append(f"{name}: different keys")
            continue
        for key, t in a[name].items():
            u = b[name][key]
            if t.shape != u.shape or t.dtype != u.dtype or not torch.equal(t, u):
                err = (t.double() - u.double()).abs().max().item() if t.shape == u.shape else -1
                diffs.append(f"{name}.{key}: max |diff| {err:.3g}")
    if diffs:
        return False, f"parity: DIFFERS in {len(diffs)} tensor(s): " + "; ".join(diffs[:6])
    tensors = sum(len(v) for v in a.values())
    return True, f"parity: exact ({len(a)} tasks, {tensors} tensors equal bit for bit)"


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.1f}"


def _rate(n: float | None, s: float) -> str:
    return "n/a" if n is None or s <= 0 else f"{n / s / MiB:.0f}"


def run(cfg: Config, spill_dir: str | None, keep: bool = False, fixed_mmap: bool = False) -> int:
    """Measure both configurations; prints the table; returns the exit status."""
    sz = sizes(cfg)
    root = spill_dir or os.getcwd()
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="disk_tier-", dir=root)
    status = 0
    try:
        fs = file_system(work)
        print(
            f"disk_tier: {cfg.tasks} tasks, MLP width {cfg.width} depth {cfg.depth}, batch "
            f"{cfg.batch} x {cfg.batches} batches, 1 epoch, Adam; state {_mib(sz['task_state'])} "
            f"MiB/task, {_mib(sz['total_state'])} MiB in all; {sz['shards']} shards each under "
            f"device_memory {_mib(sz['device_memory'])} MiB on {cfg.devices} emulated device(s) "
            f"(copy_on_cpu); host_memory {_mib(sz['host_memory'])} MiB "
            f"({cfg.host_frac:g} of the states; largest shard {_mib(sz['max_shard_state'])} MiB, "
            f"(devices + 2) x it = {_mib((cfg.devices + 2) * sz['max_shard_state'])} MiB)"
        )
        print(
            f"spill_dir {work} on {fs['source']} ({fs['fstype']}, mounted at {fs['mount']}, "
            f"{fs['free_bytes'] / 2**30:.0f} GiB free); torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs"
        )
        if fixed_mmap:
            print("runs with MALLOC_MMAP_THRESHOLD_=131072 (glibc: freed tensors unmapped)")
        if fs["in_ram"]:
            print("WARNING: spill_dir is on a RAM file system: disk figures are RAM figures")
        bw = bandwidth(work, cfg.bw_mib)
        print(
            f"sequential bandwidth here ({bw['bytes'] // MiB} MiB file, 8 MiB chunks): "
            f"write + fsync {_rate(bw['write_Bps'], 1)} MiB/s, read after FADV_DONTNEED "
            f"{_rate(bw['read_Bps'], 1)} MiB/s, re-read (page cache) "
            f"{_rate(bw['cached_read_Bps'], 1)} MiB/s"
        )
        runs: dict[str, dict[str, Any]] = {}
        for key, host_memory in (("disk", sz["host_memory"]), ("ram", None)):
            spec = {
                "config": asdict(cfg),
                "device_memory": sz["device_memory"],
                "host_memory": host_memory,
                "spill_dir": work if host_memory is not None else None,
                "weights": os.path.join(work, f"weights-{key}.pt"),
            }
            runs[key] = run_child(spec, timeout=1800, fixed_mmap=fixed_mmap)
            if "error" in runs[key]:
                print(f"ERROR in run {key}:\n{runs[key]['error']}")
                status = 1
        if status:
            return status
        status = report(cfg, sz, bw, runs)
        same, line = compare(
            os.path.join(work, "weights-disk.pt"), os.path.join(work, "weights-ram.pt")
        )
        print(line)
        return status if same else 1
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def report(
    cfg: Config, sz: dict[str, int], bw: dict[str, float], runs: dict[str, dict[str, Any]]
) -> int:
    """Print the table of the two runs and the disk run's details; the exit status."""
    a, b = runs["disk"], runs["ram"]
    rate = {k: r["samples"] / r["wall_s"] for k, r in runs.items()}
    print(
        f"{'run':<30} {'wall s':>7} {'samples/s':>10} {'vs RAM':>7} {'peak RSS - base':>16} "
        f"{'bound':>9} {'written':>9} {'read':>9} {'disk wait':>10}"
    )
    bounds = {
        "disk": sz["host_memory"] + cfg.devices * sz["device_memory"],
        "ram": sz["total_state"] + cfg.devices * sz["device_memory"],
    }
    labels = {
        "disk": f"(a) host_memory {_mib(sz['host_memory'])} MiB",
        "ram": "(b) host_memory None",
    }
    for key in ("disk", "ram"):
        r = runs[key]
        host = r["host"] or {}
        grew = r["peak"]["VmRSS"] - r["baseline"]["VmRSS"]
        wait = host.get("disk_wait_s")
        print(
            f"{labels[key]:<30} {r['wall_s']:>7.2f} {rate[key]:>10.0f} "
            f"{rate[key] / rate['ram']:>6.2f}x {_mib(grew):>12} MiB {_mib(bounds[key]):>5} MiB "
            f"{_mib(host.get('written_bytes')):>5} MiB {_mib(host.get('read_bytes')):>5} MiB "
            f"{'n/a' if wait is None else f'{wait:.2f} s':>10}"
        )
    host = a["host"] or {}
    written, read = host.get("written_bytes"), host.get("read_bytes")
    wall = a["wall_s"]
    both = None if written is None or read is None else written + read
    print(
        f"bound: (a) host_memory + {cfg.devices} x device_memory; (b) all states + "
        f"{cfg.devices} x device_memory (emulated devices hold their shards in host RAM)"
    )
    print(
        f"(a) throughput {rate['disk'] / rate['ram']:.2f}x of (b); disk traffic "
        f"{_rate(both, wall)} MiB/s (write {_rate(written, wall)} MiB/s, read "
        f"{_rate(read, wall)} MiB/s) vs sequential write + fsync {_rate(bw['write_Bps'], 1)} "
        f"MiB/s, read {_rate(bw['read_Bps'], 1)} MiB/s, page-cache read "
        f"{_rate(bw['cached_read_Bps'], 1)} MiB/s"
    )
    print(
        f"(a) block device during training: read {_mib(a['block_read'])} MiB, written "
        f"{_mib(a['block_written'])} MiB (the rest of the engine's traffic stayed in the page "
        f"cache; other processes' I/O counts too)"
    )
    for key in ("disk", "ram"):
        r = runs[key]
        base, peak = r["baseline"], r["peak"]
        print(
            f"{labels[key][:3]} RSS: baseline "
            f"{_mib(base['VmRSS'])} MiB (anon {_mib(base.get('RssAnon'))}, file "
            f"{_mib(base.get('RssFile'))}), peak sampled {_mib(peak['VmRSS'])} MiB (peaks: anon "
            f"{_mib(peak.get('RssAnon'))}, file {_mib(peak.get('RssFile'))}, shmem "
            f"{_mib(peak.get('RssShmem'))}; {r['rss_samples']} samples), kernel peak (VmHWM) "
            f"{_mib(r['hwm'])} MiB; grew {_mib(peak['VmRSS'] - base['VmRSS'])} MiB (anon "
            f"{_mib(peak.get('RssAnon', 0) - base.get('RssAnon', 0))}) vs "
            f"{_mib(bounds[key])} MiB"
        )
    print(
        f"(a) engine's host account: peak held {_mib(host.get('peak_held_bytes'))} MiB of "
        f"{_mib(host.get('budget'))} MiB; {host.get('spills')} spills, {host.get('loads')} "
        f"loads; trace disk: read {_mib((a['trace_disk'] or {}).get('read_bytes'))} MiB, "
        f"written {_mib((a['trace_disk'] or {}).get('written_bytes'))} MiB, wait "
        f"{(a['trace_disk'] or {}).get('wait_s', float('nan')):.2f} s"
    )
    util = ", ".join(f"{d} {u:.0%}" for d, u in a["utilization"].items())
    util_b = ", ".join(f"{d} {u:.0%}" for d, u in b["utilization"].items())
    print(f"device utilization: (a) {util}; (b) {util_b}")
    print(f"trace.validate(host_budget={sz['host_memory']}): {a['trace_check']}")
    print(f"trace.validate() of (b): {b['trace_check']}")
    same_loss = a["losses"] == b["losses"]
    print(f"final losses equal: {'yes' if same_loss else 'NO'}")
    ok = a["trace_check"] == "ok" and b["trace_check"] == "ok" and same_loss
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    parser.add_argument(
        "--spill-dir",
        default=None,
        help="where the spill folder and the bandwidth file go (default: the current dir)",
    )
    parser.add_argument("--devices", type=int, default=None, choices=(1, 2))
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--bw-mib", type=int, default=None, help="bandwidth file size (MiB)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument(
        "--fixed-mmap-threshold",
        action="store_true",
        help="run with glibc's mmap threshold fixed at 128 KiB (RSS without malloc's cache)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        try:
            out = child(json.loads(args.child))
        except Exception:
            traceback.print_exc()
            return 1
        print(json.dumps(out))
        return 0
    cfg = copy.copy(QUICK if args.quick else Config())
    for name in ("devices", "width", "batches", "bw_mib"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    return run(cfg, args.spill_dir, keep=args.keep, fixed_mmap=args.fixed_mmap_threshold)


if __name__ == "__main__":
    sys.exit(main())
