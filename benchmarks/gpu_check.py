"""GPU check for a lent H200: spilled GPT-2-XL-like training vs resident, offload, parity.

Needs only torch and the engine (``tune_hydra.engine``; never Ray, never
``tune_hydra.frontends.ray``). Measures, on ``cuda:0``:

1. **spilled vs resident**: an ``nn.Sequential`` of token+position embedding, ``--layers``
   GPT-2-XL blocks (width 1600, 25 heads, MLP 6400, pre-LN, causal) and an LM head,
   bf16 autocast, AdamW, trained by ``train_models`` under a ``device_memory`` budget that
   forces spilling (about ``--budget-frac`` of the model's training state), vs the same
   model resident (``device_memory=None``: one shard) and vs plain PyTorch on the GPU.
   Throughput is tokens/s over the trace from the second batch on (the first warms up).
   Goal: spilled / resident >= 0.85.
2. **Accelerate** ``cpu_offload`` on the same model, if ``accelerate`` is importable
   (goal: spilled >= 3x its throughput); otherwise "n/a".
3. **peak memory**: ``torch.cuda.max_memory_allocated`` during the spilled run / budget
   (goal <= 1.0).
4. **multi-task utilization**: ``--tasks`` smaller models spilled on one GPU, prefetch on
   and off: device utilization and wall time. Then the same models under a budget of 1.5
   kept batches, keeping graphs (``recompute=False``, reserved per batch) vs recomputing:
   tokens/s of each, and the kept run's peak memory / budget (goal <= 1.0).
5. **parity**: a small float32 model trained by the engine on the GPU (TF32 off) vs the
   same model trained plainly on the CPU: max relative loss and parameter differences.
6. **th.shard loops**: ``--tasks`` + 1 users' training loops (``th.shard``) in threads on
   one engine on the device (each its own small GPT, AdamW): all must finish (none stalled
   behind autograd's one CUDA worker thread per device) and each loop's weights must equal
   the same loop run plainly on the device (TF32 off); wall time vs the loops run plainly
   one after the other.
8. **shared base** (#22): 4 LoRA-like trials (plain ``nn.Module`` layers: a frozen
   ``Linear`` of one base plus a rank-r adapter, ranks 4 to 32, Adam, float32) over one
   base that each trial loads from the same state dict, spilled under a device budget of
   about a third of one trial's state, with ``share_frozen=True`` vs ``False``: bytes
   copied to the device per step (one batch of every trial), samples/s, peak device
   memory, and whether the weights are bitwise equal (TF32 off). Needs neither peft nor
   transformers.
7. **disk tier** (on a GPU only; skipped with a printed line on the CPU): 3 float32
   MLPs (``Linear`` + GELU stacks, Adam) spilled on ``cuda:0`` with
   ``host_memory`` = 1/4 of their training states and ``spill_dir`` a fresh folder under
   ``--spill-dir`` (default: the working directory), vs the same with
   ``host_memory=None``: the weights must be bitwise equal (TF32 off); bytes written and
   read, disk bytes/s over the training's wall time, disk wait, and
   ``trace.validate(host_budget=...)``.

Prints a table last and writes the figures as JSON to ``--out``.

Run::

    python benchmarks/gpu_check.py --out gpu_check.json          # on the H200, < 8 min
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu.json      # CPU, < 30 s (tests)
    python benchmarks/gpu_check.py --tiny --disk-on-cpu            # plus the disk part

``--tiny`` shrinks everything and runs on ``devices=["cpu"]`` with ``copy_on_cpu=True``
(the spill path really copies), so the script is exercised where there is no GPU; the
disk-tier part runs there only with ``--disk-on-cpu``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tune_hydra.engine.registration.partition import layer_costs
from tune_hydra.engine.task import model_layers
from tune_hydra.frontends.task_loop import TaskLoop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check_loops


@dataclass
class Config:
    """Sizes of one check run."""

    width: int = 1600
    heads: int = 25
    layers: int = 8
    vocab: int = 8192
    seq: int = 1024
    batch: int = 16
    batches: int = 6
    budget_frac: float = 0.3
    tasks: int = 3
    task_layers: int = 4
    parity_width: int = 64
    disk_tasks: int = 3
    disk_width: int = 2048
    disk_layers: int = 8
    disk_batch: int = 256
    disk_batches: int = 4
    lora_width: int = 4096
    lora_layers: int = 8
    lora_batch: int = 128
    lora_batches: int = 8
    tiny: bool = False


TINY = Config(
    width=64,
    heads=4,
    layers=4,
    vocab=128,
    seq=16,
    batch=2,
    batches=4,
    tasks=2,
    task_layers=2,
    parity_width=16,
    disk_tasks=4,
    disk_width=32,
    disk_layers=6,
    disk_batch=4,
    disk_batches=2,
    lora_width=32,
    lora_layers=4,
    lora_batch=4,
    lora_batches=2,
    tiny=True,
)


class Embed(nn.Module):
    """Token + learned position embedding."""

    def __init__(self, vocab: int, width: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Block(nn.Module):
    """A GPT-2 block: pre-LN causal self-attention and a 4x GELU MLP, no dropout."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.lm = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def make_gpt(cfg: Config, layers: int) -> nn.Sequential:
    """Embedding, ``layers`` blocks, head."""
    torch.manual_seed(0)
    return nn.Sequential(
        Embed(cfg.vocab, cfg.width, cfg.seq),
        *(Block(cfg.width, cfg.heads) for _ in range(layers)),
        Head(cfg.width, cfg.vocab),
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over all positions."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def token_data(cfg: Config, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic token batches (inputs, next tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(cfg.batches):
        seq = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def spill_budget(
    model: nn.Sequential, sample: torch.Tensor, frac: float, dtype: torch.dtype | None
) -> tuple[int, int]:
    """``(budget, state bytes)``: about ``frac`` of the model's training state as the
    partitioner estimates it, but at least what the largest layer needs beside the
    prefetched shard's state (plus 1/8 headroom)."""
    costs = layer_costs(model_layers(model), adamw, sample, dtype)
    total = sum(c.state_bytes for c in costs)
    floor = max(c.total_bytes for c in costs) + max(c.state_bytes for c in costs)
    return max(int(total * frac), floor + floor // 8), total


def tokens_per_s(history: th.History, tokens_per_batch: int) -> float:
    """Tokens/s over the trace, from the first op of batch 1 to the last op (all tasks)."""
    events = [e for e in history.trace.events if e.is_compute]
    later = [e for e in events if e.batch >= 1 and e.op in ("F", "L", "B")]
    if not later:
        return math.nan
    start = min(e.start for e in later)
    end = max(e.end for e in events)
    batches = len({(e.task, e.iteration, e.batch) for e in later})
    return batches * tokens_per_batch / (end - start)


def memory_replay(history: th.History, budget: int) -> str:
    """``"ok"`` if replaying the trace's copies keeps every device's shard state plus the
    running op's activations (from the plans) within ``budget``, else the error."""
    assert all(p.budget == budget for p in history.plans.values())
    try:
        history.validate()
    except th.TuneHydraError as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "ok"


class Check:
    """Runs the measurements for one configuration."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.gpu = not cfg.tiny
        self.device = "cuda:0" if self.gpu else "cpu"
        self.engine_kw: dict[str, Any] = {} if self.gpu else {"copy_on_cpu": True}
        self.tokens = cfg.batch * cfg.seq
        self.data = token_data(cfg)
        self.results: dict[str, Any] = {"config": asdict(cfg), "device": self._device_name()}
        self.errors: dict[str, str] = {}

    def _device_name(self) -> str:
        if self.gpu:
            return torch.cuda.get_device_name(0)
        return "cpu (tiny mode)"

    def _task(self, model: nn.Module, data: Any = None) -> th.ModelTask:
        return th.ModelTask(model, lm_loss, adamw, data if data is not None else self.data)

    def _reset_peak(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def _peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.gpu else 0

    def guarded(self, name: str, fn: Callable[[], None]) -> None:
        """Run one measurement; an error is recorded and the others still run."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as err:
            self.errors[name] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)

    def loop_part(self, key: str, fn: Callable[[str, dict[str, Any]], Any]) -> Callable[[], None]:
        """A part of :mod:`gpu_check_loops`, its figures recorded under ``key``."""

        def run() -> None:
            self.results[key] = fn(self.device, dict(self.engine_kw))

        return run

    # -- the measurements ----------------------------------------------------------------

    def spilled_vs_resident(self) -> None:
        cfg = self.cfg
        model = make_gpt(cfg, cfg.layers)
        budget, total = spill_budget(model, self.data[0][0], cfg.budget_frac, torch.bfloat16)
        r = self.results
        r["model_params"] = sum(p.numel() for p in model.parameters())
        r["state_bytes"], r["budget_bytes"] = total, budget

        self._reset_peak()
        h = self._train_one(model, budget)
        r["spilled_trace_memory"] = memory_replay(h, budget)
        r["spilled_tokens_s"] = tokens_per_s(h, self.tokens)
        r["spilled_shards"] = h["gpt"][0]["num_shards"]
        r["peak_bytes"] = self._peak()
        r["peak_over_budget"] = r["peak_bytes"] / budget if self.gpu else None
        r["spilled_devices"] = h.summary.get("devices", {})
        self._reset_peak()
        h = self._train_one(model, None)
        r["resident_tokens_s"] = tokens_per_s(h, self.tokens)
        r["resident_shards"] = h["gpt"][0]["num_shards"]
        r["spilled_over_resident"] = r["spilled_tokens_s"] / r["resident_tokens_s"]
        r["plain_tokens_s"] = self._plain(copy.deepcopy(model))
        r["spilled_over_plain"] = r["spilled_tokens_s"] / r["plain_tokens_s"]

    def _train_one(self, model: nn.Module, budget: int | None) -> th.History:
        """One epoch of a copy of ``model`` by the engine under ``budget`` (None: resident)."""
        return th.train_models(
            {"gpt": self._task(copy.deepcopy(model))},
            devices=[self.device],
            device_memory=budget,
            epochs=1,
            precision="bf16",
            seed=0,
            **self.engine_kw,
        )

    def _plain(self, model: nn.Module) -> float:
        """Plain PyTorch bf16-autocast training on the device; tokens/s after batch 0."""
        model.to(self.device)
        tps = self._timed_loop(model, self.data)
        model.to("cpu")
        return tps

    def _timed_loop(self, model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Train ``model`` plainly over ``data`` (bf16 autocast); tokens/s after batch 0."""
        opt = adamw(list(model.parameters()))
        stamps = []
        for x, y in data:
            with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16):
                loss = lm_loss(model(x.to(self.device)), y.to(self.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if self.gpu:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
        return (len(stamps) - 1) * self.tokens / (stamps[-1] - stamps[0])

    def accelerate(self) -> None:
        try:
            from accelerate import cpu_offload
        except ImportError:
            self.results["accelerate_tokens_s"] = None
            self.results["spilled_over_accelerate"] = None
            return
        model = make_gpt(self.cfg, self.cfg.layers)
        cpu_offload(model, execution_device=torch.device(self.device))
        tps = self._timed_loop(model, self.data[:3])
        self.results["accelerate_tokens_s"] = tps
        if "spilled_tokens_s" in self.results:
            self.results["spilled_over_accelerate"] = self.results["spilled_tokens_s"] / tps

    def _multitask_run(self, models: list[nn.Sequential], budget: int, **kw: Any) -> dict:
        """Train copies of ``models`` together on the device under ``budget``; figures."""
        tasks = {f"m{i}": self._task(copy.deepcopy(m)) for i, m in enumerate(models)}
        self._reset_peak()
        t0 = time.perf_counter()
        h = th.train_models(
            tasks,
            devices=[self.device],
            device_memory=budget,
            epochs=1,
            precision="bf16",
            seed=0,
            **kw,
            **self.engine_kw,
        )
        return {
            "budget_bytes": budget,
            "wall_s": time.perf_counter() - t0,
            "trace_wall_s": h.trace.wall_s(),
            "utilization": max(h.trace.utilization().values()),
            "tokens_s": tokens_per_s(h, self.tokens),
            "shards": h["m0"][0]["num_shards"],
            "trace_memory": memory_replay(h, budget),
            "peak_over_budget": self._peak() / budget if self.gpu else None,
        }

    def multitask(self) -> None:
        cfg = self.cfg
        models = [make_gpt(cfg, cfg.task_layers) for _ in range(cfg.tasks)]
        budget, _ = spill_budget(models[0], self.data[0][0], cfg.budget_frac, torch.bfloat16)
        for prefetch in (True, False):
            key = "on" if prefetch else "off"
            self.results[f"multitask_prefetch_{key}"] = self._multitask_run(
                models, budget, prefetch=prefetch
            )

    def kept_vs_recompute(self) -> None:
        """The multi-task models at a budget of 1.5 of one task's kept batch: keeping the
        forward graphs (``recompute=False``: a batch's graphs reserved, about one batch in
        flight) vs recomputing them (more tasks in flight, a third more compute)."""
        cfg = self.cfg
        models = [make_gpt(cfg, cfg.task_layers) for _ in range(cfg.tasks)]
        with th.Engine(devices=[self.device], recompute=False, **self.engine_kw) as eng:
            probe = TaskLoop("probe", self._task(copy.deepcopy(models[0])), eng, precision="bf16")
            probe.cut()  # its plan, sized on its first batch as training would size it
            budget = int(1.5 * eng.plan("probe").kept_peak_bytes())
            probe.close()
        for recompute in (False, True):
            key = "multitask_recompute" if recompute else "multitask_kept"
            self.results[key] = self._multitask_run(models, budget, recompute=recompute)

    def parity(self) -> None:
        cfg = self.cfg
        small = Config(
            width=cfg.parity_width,
            heads=4,
            layers=3,
            vocab=64,
            seq=16,
            batch=4,
            batches=4,
            tiny=cfg.tiny,
        )
        data = token_data(small, seed=1)
        model = make_gpt(small, small.layers)
        ref = copy.deepcopy(model)
        budget, _ = spill_budget(model, data[0][0], 0.5, None)
        if self.gpu:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        h = th.train_models(
            {"p": self._task(model, data)},
            devices=[self.device],
            device_memory=budget,
            epochs=2,
            seed=0,
            **self.engine_kw,
        )
        plain = th.train_plain(self._task(ref, data), 2, seed=0)
        loss_rel = max(
            abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(h["p"], plain, strict=True)
        )
        param_rel = max(
            ((a.detach().cpu() - b.detach()).norm() / b.detach().norm().clamp_min(1e-12)).item()
            for a, b in zip(model.parameters(), ref.parameters(), strict=True)
        )
        self.results["parity"] = {
            "shards": h["p"][0]["num_shards"],
            "loss_rel": loss_rel,
            "param_rel": param_rel,
            "ok": loss_rel < 1e-4 and param_rel < 1e-4,
        }

    def shard_loops(self) -> None:
        """``cfg.tasks + 1`` users' loops (``th.shard``) in threads on one engine on the
        device, each with its own small GPT: they must all finish (autograd runs a CUDA
        backward on one worker thread per device for the whole process: a backward that
        waited there for its shard's turn would block every loop's), and each loop's
        weights must equal the same loop run plainly on the device (TF32 off)."""
        import threading

        cfg = self.cfg
        small = Config(
            width=cfg.parity_width * 4,
            heads=4,
            layers=4,
            vocab=256,
            seq=64 if self.gpu else 16,
            batch=8 if self.gpu else 2,
            batches=6 if self.gpu else 3,
            tiny=cfg.tiny,
        )
        if self.gpu:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        n = cfg.tasks + 1
        datas = [token_data(small, seed=10 + i) for i in range(n)]
        models = [make_gpt(small, small.layers) for _ in range(n)]
        refs = [copy.deepcopy(m).to(self.device) for m in models]
        budget, _ = spill_budget(models[0], datas[0][0][0], 0.5, None)

        def loop(model: nn.Module, data: Any, errors: list[str]) -> None:
            try:
                opt = adamw(list(model.parameters()))
                if engine is not None:
                    model, opt = th.shard(model, opt, engine=engine)
                for x, y in data:
                    opt.zero_grad()
                    lm_loss(model(x.to(self.device)), y.to(self.device)).backward()
                    opt.step()
            except Exception as err:  # reported below: one loop's error is the figure
                errors.append(f"{type(err).__name__}: {err}")

        engine = None
        t0 = time.perf_counter()
        for ref, data in zip(refs, datas, strict=True):
            loop(ref, data, [])
        if self.gpu:
            torch.cuda.synchronize()
        plain_s = time.perf_counter() - t0
        engine = th.Engine(devices=[self.device], device_memory=budget, **self.engine_kw)
        errors: list[str] = []
        threads = [
            threading.Thread(target=loop, args=(m, d, errors), daemon=True)
            for m, d in zip(models, datas, strict=True)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        sharded_s = time.perf_counter() - t0
        stalled = sum(t.is_alive() for t in threads)
        exact = worst = None
        if not stalled and not errors:
            homes = [th.unshard(m) for m in models]
            pairs = [
                (a.detach().cpu(), b.detach().cpu())
                for home, ref in zip(homes, refs, strict=True)
                for a, b in zip(home.parameters(), ref.parameters(), strict=True)
            ]
            exact = all(torch.equal(a, b) for a, b in pairs)
            worst = max(((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in pairs)
            engine.close()
        self.results["shard_loops"] = {
            "loops": n,
            "stalled": stalled,
            "errors": errors,
            "exact": exact,
            "param_rel": worst,
            "sharded_s": sharded_s,
            "plain_sequential_s": plain_s,
            "ok": not stalled and not errors and worst is not None and worst < 1e-5,
        }

    def shared_base(self) -> None:
        """4 LoRA-like trials over one base loaded by each, spilled on the device, with
        the frozen base shared (one host copy, one device copy per residency, aligned
        cuts) vs not: bytes copied in per step, samples/s, peak memory, equal weights."""
        cfg = self.cfg
        if self.gpu:  # bitwise equality needs the same kernels in both runs
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        n = len(LORA_RANKS)
        base = lora_base(cfg.lora_width, cfg.lora_layers)
        datas = [lora_data(cfg, seed=i) for i in range(n)]

        def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.Adam(params, lr=1e-3)

        largest = lora_trial(base, cfg.lora_width, cfg.lora_layers, n - 1)
        costs = layer_costs(model_layers(largest), adam, datas[0][0][0])
        state = sum(c.state_bytes for c in costs)
        floor = max(c.total_bytes for c in costs) + max(c.state_bytes for c in costs)
        budget = max(state // 3, floor + floor // 8)
        base_bytes = sum(t.numel() * t.element_size() for t in base.values())
        r: dict[str, Any] = {
            "trials": n,
            "ranks": list(LORA_RANKS),
            "base_bytes": base_bytes,
            "device_memory": budget,
        }
        self.results["shared_base"] = r
        weights = {}
        samples = n * cfg.lora_batches * cfg.lora_batch
        for key, share in (("shared", True), ("unshared", False)):
            models = [lora_trial(base, cfg.lora_width, cfg.lora_layers, i) for i in range(n)]
            self._reset_peak()
            with th.Engine(
                devices=[self.device],
                device_memory=budget,
                share_frozen=share,
                policy="lrtf",
                **self.engine_kw,
            ) as eng:
                names = [f"l{i}" for i in range(n)]
                loops = []
                for i, (name, model) in enumerate(zip(names, models, strict=True)):
                    task = th.ModelTask(model, nn.CrossEntropyLoss(), adam, datas[i])
                    loops.append(TaskLoop(name, task, eng, seed=i))
                    loops[-1].cut()  # all registered (cut) before any trains, as before
                t0 = time.perf_counter()
                futures = [loop.start(1) for loop in loops]
                for future in futures:
                    future.result(timeout=600)
                wall = time.perf_counter() - t0
                events = eng.trace.events
                r[key] = {
                    "wall_s": wall,
                    "samples_s": samples / wall,
                    "copied_in_per_step": sum(e.bytes_moved for e in events if e.op == "copy_in")
                    / cfg.lora_batches,
                    "copied_back_per_step": sum(e.bytes_moved for e in events if e.op == "copy_out")
                    / cfg.lora_batches,
                    "peak_bytes": self._peak(),
                    "shards": [len(eng.plan(name)) for name in names],
                    "cuts": [[(s.start, s.stop) for s in eng.plan(nm).shards] for nm in names],
                    "pool_bytes": eng._registry.frozen.held_bytes(),
                }
                for loop in loops:
                    loop.close()  # its model back on the CPU, the user's class again
            weights[key] = [m.state_dict() for m in models]
        equal, worst = True, 0.0
        for a, b in zip(weights["shared"], weights["unshared"], strict=True):
            for name, t in a.items():
                if not torch.equal(t, b[name]):
                    equal = False
                    worst = max(worst, (t.double() - b[name].double()).abs().max().item())
        s, u = r["shared"], r["unshared"]
        r["bitwise_equal"] = equal
        r["max_abs_diff"] = worst
        r["copied_ratio"] = u["copied_in_per_step"] / max(1.0, s["copied_in_per_step"])
        r["samples_ratio"] = s["samples_s"] / u["samples_s"]
        r["ok"] = equal and s["copied_in_per_step"] < u["copied_in_per_step"]

    def disk_tier(self, spill_root: str) -> None:
        """Float32 MLPs whose states sum to 4x ``host_memory``, spilling to a folder under
        ``spill_root``, vs unlimited host memory: bitwise-equal weights, disk figures."""
        cfg = self.cfg
        if self.gpu:  # bitwise equality needs the same kernels in both runs
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        torch.manual_seed(0)
        models = [disk_mlp(cfg.disk_width, cfg.disk_layers) for _ in range(cfg.disk_tasks)]
        data = [disk_data(cfg, seed=i) for i in range(cfg.disk_tasks)]
        costs = layer_costs(model_layers(models[0]), _disk_adam, data[0][0][0])
        state = sum(c.state_bytes for c in costs)
        floor = max(c.total_bytes for c in costs) + max(c.state_bytes for c in costs)
        device_memory = max(int(state * 0.3), floor + floor // 8)
        host_memory = state * cfg.disk_tasks // 4
        folder = tempfile.mkdtemp(prefix="gpu_check-spill-", dir=spill_root)
        r: dict[str, Any] = {
            "tasks": cfg.disk_tasks,
            "state_bytes": state * cfg.disk_tasks,
            "host_memory": host_memory,
            "device_memory": device_memory,
            "spill_dir": folder,
        }
        self.results["disk_tier"] = r
        weights = {}
        try:
            for key, host in (("disk", host_memory), ("ram", None)):
                copies = [copy.deepcopy(m) for m in models]
                with th.Engine(
                    devices=[self.device],
                    device_memory=device_memory,
                    host_memory=host,
                    spill_dir=folder if host is not None else None,
                    **self.engine_kw,
                ) as eng:
                    names = [f"d{i}" for i in range(cfg.disk_tasks)]
                    loops = []
                    for i, (name, model) in enumerate(zip(names, copies, strict=True)):
                        task = th.ModelTask(model, nn.CrossEntropyLoss(), _disk_adam, data[i])
                        loops.append(TaskLoop(name, task, eng, seed=i))
                        loops[-1].cut()  # all registered (cut) before any trains
                    t0 = time.perf_counter()
                    futures = [loop.start(1) for loop in loops]
                    for future in futures:
                        future.result(timeout=600)
                    wall = time.perf_counter() - t0
                    host_figures = eng.summary().get("host") or {}
                    plan = eng.plan(names[0])
                    r["max_shard_state"] = max(sh.state_bytes for sh in plan.shards)
                    r[key] = {
                        "wall_s": wall,
                        "samples_s": cfg.disk_tasks * cfg.disk_batches * cfg.disk_batch / wall,
                        "shards": len(plan),
                        "host": host_figures,
                        "trace_host": _host_replay(eng.trace, host),
                    }
                    if host is not None and r[key]["trace_host"] != "ok":
                        # Below (devices + 2) x the largest shard the engine may go over
                        # by up to (devices + 1) x it (documented slack): within that?
                        slack = (1 + 1) * r["max_shard_state"]  # one device
                        r[key]["trace_host_with_slack"] = _host_replay(eng.trace, host + slack)
                    for loop in loops:
                        loop.close()  # its model back on the CPU, in RAM (read from disk)
                weights[key] = [m.state_dict() for m in copies]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        disk = r["disk"]
        moved = disk["host"].get("written_bytes", 0) + disk["host"].get("read_bytes", 0)
        disk["disk_Bps"] = moved / disk["wall_s"]
        r["disk_over_ram"] = disk["samples_s"] / r["ram"]["samples_s"]
        equal, worst = True, 0.0
        for a, b in zip(weights["disk"], weights["ram"], strict=True):
            for name, t in a.items():
                if not torch.equal(t, b[name]):
                    equal = False
                    worst = max(worst, (t.double() - b[name].double()).abs().max().item())
        r["bitwise_equal"] = equal
        r["max_abs_diff"] = worst


class LoRALinear(nn.Module):
    """A frozen ``Linear`` of the base plus a trainable rank-``r`` adapter, then GELU."""

    def __init__(self, base: nn.Linear, r: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, r) / r**0.5 * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t())


LORA_RANKS = (4, 8, 16, 32)


def lora_base(width: int, layers: int) -> dict[str, torch.Tensor]:
    """The 'pretrained' base every trial loads."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).state_dict()


def lora_trial(base: dict[str, torch.Tensor], width: int, layers: int, i: int) -> nn.Sequential:
    """Trial ``i``: its own copy of the base, loaded, and adapters of its rank."""
    lins = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    lins.load_state_dict(base)
    torch.manual_seed(100 + i)
    return nn.Sequential(*(LoRALinear(lin, LORA_RANKS[i % len(LORA_RANKS)]) for lin in lins))


def lora_data(cfg: Config, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(cfg.lora_batch, cfg.lora_width, generator=g),
            torch.randint(0, cfg.lora_width, (cfg.lora_batch,), generator=g),
        )
        for _ in range(cfg.lora_batches)
    ]


def disk_mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` x (Linear + GELU) and a 10-class head: float32, no attention (its
    backward kernels may not be deterministic; bitwise comparisons need them to be)."""
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    mods.append(nn.Linear(width, 10))
    return nn.Sequential(*mods)


def disk_data(cfg: Config, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic classification batches for the disk-tier part."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(cfg.disk_batch, cfg.disk_width, generator=g),
            torch.randint(0, 10, (cfg.disk_batch,), generator=g),
        )
        for _ in range(cfg.disk_batches)
    ]


def _disk_adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def _host_replay(trace: Any, budget: int | None) -> str:
    """``"ok"`` if the trace's replayed host memory stays within ``budget`` (``None``:
    the schedule's other rules only), else the error (with the offending rows)."""
    try:
        if budget is None:
            trace.validate()
        else:
            trace.validate(host_budget=budget)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


def _jsonable(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by ``None`` (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec)


def table(r: dict[str, Any], errors: dict[str, str]) -> str:
    """The summary table (printed last)."""
    mt_on, mt_off = r.get("multitask_prefetch_on", {}), r.get("multitask_prefetch_off", {})
    kept, rec = r.get("multitask_kept", {}), r.get("multitask_recompute", {})
    par = r.get("parity", {})
    rows = [
        ("spilled tokens/s", _fmt(r.get("spilled_tokens_s")), f"{r.get('spilled_shards')} shards"),
        (
            "resident tokens/s (engine)",
            _fmt(r.get("resident_tokens_s")),
            f"{r.get('resident_shards')} shard(s)",
        ),
        ("plain PyTorch tokens/s", _fmt(r.get("plain_tokens_s")), ""),
        ("spilled / resident", _fmt(r.get("spilled_over_resident")), "goal >= 0.85"),
        ("spilled / plain", _fmt(r.get("spilled_over_plain")), ""),
        ("spilled / accelerate", _fmt(r.get("spilled_over_accelerate")), "goal >= 3"),
        ("peak / budget", _fmt(r.get("peak_over_budget")), "goal <= 1.0"),
        (
            "trace memory replay",
            str(r.get("spilled_trace_memory", "n/a"))[:10],
            f"multi-task: {str(mt_on.get('trace_memory', 'n/a'))[:40]}",
        ),
        (
            "multi-task util, prefetch on",
            _fmt(mt_on.get("utilization"), ".0%"),
            f"{_fmt(mt_on.get('tokens_s'))} tok/s",
        ),
        (
            "multi-task peak / budget",
            _fmt(mt_on.get("peak_over_budget")),
            "goal <= 1.0",
        ),
        (
            "multi-task util, prefetch off",
            _fmt(mt_off.get("utilization"), ".0%"),
            f"{_fmt(mt_off.get('tokens_s'))} tok/s",
        ),
        (
            "kept graphs tok/s",
            _fmt(kept.get("tokens_s")),
            f"recompute: {_fmt(rec.get('tokens_s'))} tok/s at the same "
            f"{_fmt((kept.get('budget_bytes') or 0) / 2**30)} GiB",
        ),
        (
            "kept graphs peak / budget",
            _fmt(kept.get("peak_over_budget")),
            f"goal <= 1.0; replay {str(kept.get('trace_memory', 'n/a'))[:30]}",
        ),
        ("fp32 parity loss rel", _fmt(par.get("loss_rel"), ".2e"), "vs plain on CPU"),
        (
            "fp32 parity param rel",
            _fmt(par.get("param_rel"), ".2e"),
            "ok" if par.get("ok") else "CHECK",
        ),
    ]
    head = (
        f"gpu_check on {r.get('device')}: {r['config']['layers']} blocks width "
        f"{r['config']['width']}, {_fmt(r.get('model_params'))} params, budget "
        f"{_fmt((r.get('budget_bytes') or 0) / 2**30)} GiB of "
        f"{_fmt((r.get('state_bytes') or 0) / 2**30)} GiB state"
    )
    loops = r.get("shard_loops", {})
    if loops:
        rows += [
            (
                f"th.shard loops x{loops.get('loops')} (s)",
                _fmt(loops.get("sharded_s")),
                f"plain one after another {_fmt(loops.get('plain_sequential_s'))} s; "
                f"stalled {loops.get('stalled')}, errors {len(loops.get('errors') or [])}",
            ),
            (
                "th.shard loops param rel",
                _fmt(loops.get("param_rel"), ".2e"),
                f"exact {loops.get('exact')}; " + ("ok" if loops.get("ok") else "CHECK"),
            ),
        ]
    rows += _shared_base_rows(r.get("shared_base", {}))
    rows += _disk_rows(r.get("disk_tier", {}))
    rows += gpu_check_loops.rows(r)
    lines = [head, f"{'figure':<32} {'value':>10}  note"]
    lines += [f"{a:<32} {b:>10}  {c}" for a, b, c in rows]
    lines += [f"ERROR {k}: {v}" for k, v in errors.items()]
    return "\n".join(lines)


def _shared_base_rows(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The shared-base part's rows of the table."""
    if "shared" not in d or "unshared" not in d:
        return [("shared base", "n/a", "see ERROR")] if d else []
    s, u = d["shared"], d["unshared"]
    mib = 2**20
    return [
        (
            "shared base copied in MiB/step",
            _fmt(s["copied_in_per_step"] / mib),
            f"not shared {_fmt(u['copied_in_per_step'] / mib)} ({_fmt(d['copied_ratio'])}x); "
            f"{d['trials']} trials, base {_fmt(d['base_bytes'] / mib)} MiB",
        ),
        (
            "shared base samples/s",
            _fmt(s["samples_s"]),
            f"not shared {_fmt(u['samples_s'])} ({_fmt(d['samples_ratio'])}x)",
        ),
        (
            "shared base peak MiB",
            _fmt(s["peak_bytes"] / mib),
            f"not shared {_fmt(u['peak_bytes'] / mib)}; budget "
            f"{_fmt(d['device_memory'] / mib)} MiB",
        ),
        (
            "shared base weights vs unshared",
            "bitwise" if d.get("bitwise_equal") else _fmt(d.get("max_abs_diff"), ".2e"),
            "ok" if d.get("ok") else "CHECK (equal weights, fewer bytes copied)",
        ),
    ]


def _disk_rows(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The disk-tier part's rows of the table."""
    if "skipped" in d:
        return [("disk tier", "skipped", d["skipped"])]
    if "disk" not in d or "ram" not in d:
        return [("disk tier", "n/a", "see ERROR")] if d else []
    disk = d["disk"]
    host = disk.get("host", {})
    gib = 2**30
    equal = "bitwise" if d.get("bitwise_equal") else _fmt(d.get("max_abs_diff"), ".2e")
    return [
        (
            "disk tier / RAM samples/s",
            _fmt(d.get("disk_over_ram")),
            f"{d['tasks']} tasks x {disk.get('shards')} shards; host "
            f"{_fmt(d['host_memory'] / gib)} of {_fmt(d['state_bytes'] / gib)} GiB state",
        ),
        (
            "disk tier written / read GiB",
            f"{_fmt((host.get('written_bytes') or 0) / gib)}/"
            f"{_fmt((host.get('read_bytes') or 0) / gib)}",
            f"{_fmt(disk.get('disk_Bps', 0) / 2**20)} MiB/s; disk wait "
            f"{_fmt(host.get('disk_wait_s'))} s",
        ),
        (
            "disk tier weights vs RAM run",
            equal,
            "ok" if d.get("bitwise_equal") else "CHECK (must be bitwise equal)",
        ),
        (
            "disk tier host replay",
            str(disk.get("trace_host", "n/a"))[:10],
            f"peak held {_fmt((host.get('peak_held_bytes') or 0) / gib)} GiB; "
            f"(1 + 2) x largest shard {_fmt(3 * d.get('max_shard_state', 0) / gib)} GiB"
            + (
                f"; with slack: {str(disk['trace_host_with_slack'])[:10]}"
                if "trace_host_with_slack" in disk
                else ""
            ),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU (tests)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--budget-frac", type=float, default=None)
    parser.add_argument(
        "--spill-dir", default=None, help="disk tier: folder for spill files (default: cwd)"
    )
    parser.add_argument(
        "--disk-on-cpu",
        action="store_true",
        help="with --tiny: run the disk-tier part on the CPU too (copy_on_cpu)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="run only this part (repeatable), as named in the log, e.g. 'shared base'",
    )
    args = parser.parse_args(argv)
    cfg = copy.copy(TINY if args.tiny else Config())
    for name in ("layers", "batch", "seq", "budget_frac"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if not cfg.tiny and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny on the CPU", file=sys.stderr)
        return 2
    if cfg.tiny:
        torch.set_num_threads(1)  # steadier on small shared CPU machines
    check = Check(cfg)
    parts: list[tuple[str, Callable[[], None]]] = [
        ("spilled vs resident", check.spilled_vs_resident),
        ("accelerate", check.accelerate),
        ("multitask", check.multitask),
        ("kept vs recompute", check.kept_vs_recompute),
        ("parity", check.parity),
        ("shard loops", check.shard_loops),
        ("shared base", check.shared_base),
    ]
    for part, (key, loop_part) in gpu_check_loops.PARTS.items():
        parts.append((part, check.loop_part(key, loop_part)))
    for name, fn in parts:
        if args.only is None or name in args.only:
            check.guarded(name, fn)
    if args.only is not None and "disk tier" not in args.only:
        pass
    elif check.gpu or args.disk_on_cpu:
        spill_root = args.spill_dir or os.getcwd()
        check.guarded("disk tier", lambda: check.disk_tier(spill_root))
    else:
        print("[disk tier] skipped: no CUDA device (a GPU part; --disk-on-cpu runs it here)")
        check.results["disk_tier"] = {"skipped": "no CUDA device"}
    check.results["errors"] = check.errors
    if args.out:
        with open(args.out, "w") as f:
            json.dump(_jsonable(check.results), f, indent=2, default=str)
    print(table(check.results, check.errors))
    return 1 if check.errors else 0


if __name__ == "__main__":
    sys.exit(main())
