"""gpu_check.py's ``th.shard`` loop parts of issue #32: the loops big models are trained with.

Each part runs a user's loop sharded on a one-device engine and the same loop on a
``copy.deepcopy`` of the model without ``th.shard`` (plain PyTorch on the same device),
and returns its figures as a dict (gpu_check.py records them; an error is its part's
own, the other parts still run):

1. :func:`amp_bf16`: ``torch.autocast(<device>, torch.bfloat16)`` around the forward, Adam,
   under a ``device_memory`` budget that cuts the model into several shards and spills
   them: per-step losses and final weights vs plain (max abs diff; exact expected), and
   vs the fp32 loop (must differ: the autocast reached the shards).
2. :func:`amp_fp16`: fp16 autocast and ``torch.amp.GradScaler(<device>)`` whose first
   scales overflow: the same comparison plus the scale history and the skipped steps,
   spilled and with every shard resident on the device (no budget, a few layers a shard:
   the gradients the scaler checks stay on the GPU; on the CPU "resident" is in place).
3. :func:`compiled`: ``th.shard(torch.compile(model))`` vs ``torch.compile(plain copy)``,
   inductor on a GPU (``aot_eager`` on the CPU: inductor's C++ builds are too slow for the
   tests there): seconds per step (compiled steps only) sharded / plain, loss and weight
   differences (exact expected with ``aot_eager``; inductor may fuse a shard's graph
   differently from the whole model's).
4. :func:`trainer`: Hugging Face ``Trainer`` (its defaults, a tiny ``from_config`` GPT-2,
   ``use_cpu`` only on the CPU) sharded vs plain: logged losses and the ratio of
   ``train_runtime``. Skipped (not failed) where transformers or accelerate is missing.

The models are MLPs with LayerNorm (bf16/fp16 matmuls, fp32 norms), no attention and no
dropout, so that a difference is the engine's (a GPU's attention backward need not be
deterministic); the Trainer's GPT-2 keeps its dropout, with eager attention. TF32 is off.
Sizes are small: all four parts take well under a minute on an H200 (compiling included).
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tune_hydra as th
from tune_hydra.engine.registration.partition import layer_costs
from tune_hydra.engine.task import model_layers


class Sizes:
    """The loop parts' sizes on a GPU or in ``--tiny`` mode on the CPU."""

    def __init__(self, gpu: bool) -> None:
        self.width = 512 if gpu else 16
        self.blocks = 3  # 5 layers a block: 15 layers and a head
        self.batch = 64 if gpu else 4
        self.steps = 8 if gpu else 4
        self.compile_steps = 12 if gpu else 4


def mlp(sizes: Sizes) -> nn.Sequential:
    """``blocks`` x (Linear, GELU, Linear, LayerNorm, GELU) and a 10-class head."""
    torch.manual_seed(0)
    w = sizes.width
    layers: list[nn.Module] = []
    for _ in range(sizes.blocks):
        layers += [nn.Linear(w, 2 * w), nn.GELU(), nn.Linear(2 * w, w), nn.LayerNorm(w), nn.GELU()]
    layers.append(nn.Linear(w, 10))
    return nn.Sequential(*layers)


def data(sizes: Sizes, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(sizes.batch, sizes.width, generator=g), torch.randint(0, 10, (sizes.batch,)))
        for _ in range(steps)
    ]


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def budget_for(model: nn.Sequential, sample: torch.Tensor, dtype: torch.dtype | None) -> int:
    """About half the model's training state, but at least the largest layer with the
    prefetched shard's state beside it (plus 1/8): several shards, spilled."""
    costs = layer_costs(model_layers(model), adam, sample, dtype)
    floor = max(c.total_bytes for c in costs) + max(c.state_bytes for c in costs)
    return max(sum(c.state_bytes for c in costs) // 2, floor + floor // 8)


def no_tf32(gpu: bool) -> None:
    if gpu:  # fp32 matmuls in fp32: the fp32 reference and the weights' updates
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: str,
    dtype: torch.dtype | None,
    scaler: Any = None,
) -> dict[str, list[Any]]:
    """The user's loop: autocast to ``dtype`` (None: fp32) around the forward and the
    loss, backward (scaled by ``scaler`` if given), step. Per-step losses (on the CPU),
    scales after each update, and seconds per step."""
    kind = torch.device(device).type
    out: dict[str, list[Any]] = {"losses": [], "scales": [], "step_s": []}
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast(kind, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        out["losses"].append(loss.detach().cpu())
        sync(device)
        out["step_s"].append(time.perf_counter() - t0)
    return out


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True)))


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().cpu() for t in model.state_dict().values()]


def compare(want: dict[str, Any], got: dict[str, Any], ref: nn.Module, home: nn.Module) -> dict:
    """Loss and weight differences of a sharded run vs its plain reference."""
    wa, wb = weights(ref), weights(home)
    exact = all(torch.equal(x, y) for x, y in zip(want["losses"], got["losses"], strict=True))
    exact = exact and all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))
    return {
        "loss_max_abs": max_abs(want["losses"], got["losses"]),
        "weight_max_abs": max_abs(wa, wb),
        "exact": exact,
    }


def sharded_run(
    model: nn.Module,
    engine: th.Engine,
    batches: list[Any],
    device: str,
    dtype: torch.dtype | None,
    scaler: Any = None,
) -> tuple[dict[str, Any], nn.Module, int]:
    """``model`` trained by :func:`loop` under ``th.shard`` on ``engine``; its figures,
    the model unsharded (weights home) and its shard count."""
    opt = adam(model.parameters())
    sharded, opt = th.shard(model, opt, engine=engine)
    got = loop(sharded, opt, batches, device, dtype, scaler)
    shards = th.shard_count(sharded)
    return got, th.unshard(sharded), shards


def amp_bf16(device: str, engine_kw: dict[str, Any]) -> dict[str, Any]:
    gpu = device.startswith("cuda")
    no_tf32(gpu)
    sizes = Sizes(gpu)
    model, batches = mlp(sizes), data(sizes, sizes.steps)
    budget = budget_for(model, batches[0][0], torch.bfloat16)
    ref, fp32 = copy.deepcopy(model).to(device), copy.deepcopy(model).to(device)
    want = loop(ref, adam(ref.parameters()), batches, device, torch.bfloat16)
    full = loop(fp32, adam(fp32.parameters()), batches, device, None)
    with th.Engine(devices=[device], device_memory=budget, **engine_kw) as eng:
        got, home, shards = sharded_run(model, eng, batches, device, torch.bfloat16)
    r = compare(want, got, ref, home)
    r["differs_from_fp32"] = not all(
        torch.equal(a, b) for a, b in zip(full["losses"], got["losses"], strict=True)
    )
    r["loss_vs_fp32_max_abs"] = max_abs(full["losses"], got["losses"])
    r.update(shards=shards, budget_bytes=budget, ok=r["exact"] and r["differs_from_fp32"])
    return r


def amp_fp16(device: str, engine_kw: dict[str, Any]) -> dict[str, Any]:
    """fp16 + GradScaler, spilled and resident (see the module docstring)."""
    gpu = device.startswith("cuda")
    no_tf32(gpu)
    sizes = Sizes(gpu)
    kind = torch.device(device).type
    model, batches = mlp(sizes), data(sizes, sizes.steps, seed=1)

    def scaler() -> torch.amp.GradScaler:
        # 2**24: the first steps' fp16 gradients overflow, skipped by the scaler
        return torch.amp.GradScaler(kind, init_scale=2.0**24, growth_interval=2)

    ref = copy.deepcopy(model).to(device)
    want = loop(ref, adam(ref.parameters()), batches, device, torch.float16, scaler())
    init = [2.0**24, *want["scales"][:-1]]
    skipped = [s < before for s, before in zip(want["scales"], init, strict=True)]
    budget = budget_for(model, batches[0][0], torch.float16)
    engines = {
        "spilled": {"device_memory": budget, **engine_kw},
        # every shard on the device for the whole run (on the CPU: in place, no copies)
        "resident": {"max_layers_per_shard": 4},
    }
    r: dict[str, Any] = {"budget_bytes": budget, "skipped_steps": sum(skipped)}
    for key, kw in engines.items():
        with th.Engine(devices=[device], **kw) as eng:
            got, home, shards = sharded_run(
                copy.deepcopy(model), eng, batches, device, torch.float16, scaler()
            )
        c = compare(want, got, ref, home)
        c["shards"] = shards
        c["scales_equal"] = got["scales"] == want["scales"]
        c["ok"] = c["exact"] and c["scales_equal"] and sum(skipped) > 0
        r[key] = c
    r["ok"] = r["spilled"]["ok"] and r["resident"]["ok"]
    return r


def compiled(device: str, engine_kw: dict[str, Any]) -> dict[str, Any]:
    import torch._dynamo

    gpu = device.startswith("cuda")
    no_tf32(gpu)
    sizes = Sizes(gpu)
    backend = "inductor" if gpu else "aot_eager"
    model, batches = mlp(sizes), data(sizes, sizes.compile_steps, seed=2)
    # dynamo's caches are per code object (every Sequential's forward): fresh for each run
    torch._dynamo.reset()
    ref = torch.compile(copy.deepcopy(model).to(device), backend=backend)
    want = loop(ref, adam(ref.parameters()), batches, device, None)
    torch._dynamo.reset()
    budget = budget_for(model, batches[0][0], None)
    with th.Engine(devices=[device], device_memory=budget, **engine_kw) as eng:
        got, home, shards = sharded_run(
            torch.compile(model, backend=backend), eng, batches, device, None
        )
    torch._dynamo.reset()
    r = compare(want, got, ref, home)
    warm = 2  # the first steps compile (the probe, the recompute's graphs)
    plain_s = statistics.median(want["step_s"][warm:])
    sharded_s = statistics.median(got["step_s"][warm:])
    r.update(
        backend=backend,
        shards=shards,
        plain_step_s=plain_s,
        sharded_step_s=sharded_s,
        step_ratio=sharded_s / plain_s,
        first_steps_s=sum(got["step_s"][:warm]),
        plain_first_steps_s=sum(want["step_s"][:warm]),
        ok=r["exact"] if backend == "aot_eager" else r["loss_max_abs"] < 1e-3,
    )
    return r


def trainer(device: str, engine_kw: dict[str, Any]) -> dict[str, Any]:
    try:
        import accelerate  # noqa: F401  (Trainer needs it)
        import transformers
    except ImportError as err:
        return {"skipped": f"{err.name} not installed"}
    gpu = device.startswith("cuda")
    no_tf32(gpu)
    transformers.logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self, n: int, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, 64, (n, 32 if gpu else 8), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = self.ids[i]
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def fit(out: str, engine: th.Engine | None) -> tuple[list[float], float]:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=4 if gpu else 2, n_embd=128 if gpu else 16, n_head=4 if gpu else 2,
            vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
            attn_implementation="eager",
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        if engine is not None:
            model = th.shard(model, engine=engine)
        args = transformers.TrainingArguments(
            out, per_device_train_batch_size=8, max_steps=6, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=not gpu, disable_tqdm=True,
        )  # fmt: skip
        run = transformers.Trainer(model=model, args=args, train_dataset=Tokens(64, 0))
        metrics = run.train().metrics
        if engine is not None:
            th.unshard(run.model)
        losses = [h["loss"] for h in run.state.log_history if "loss" in h]
        return losses, metrics["train_runtime"]

    with tempfile.TemporaryDirectory() as tmp:
        want, plain_s = fit(f"{tmp}/plain", None)
        kw = {"max_layers_per_shard": 2, **engine_kw}
        with th.Engine(devices=[device], **kw) as eng:
            got, sharded_s = fit(f"{tmp}/sharded", eng)
    worst = max(abs(a - b) for a, b in zip(want, got, strict=True))
    return {
        "steps": len(got),
        "losses_equal": got == want,
        "loss_max_abs": worst,
        "plain_s": plain_s,
        "sharded_s": sharded_s,
        "time_ratio": sharded_s / plain_s,
        "ok": got == want and len(got) == 6,
    }


PARTS = {
    "shard bf16": ("shard_bf16", amp_bf16),
    "shard fp16 scaler": ("shard_fp16", amp_fp16),
    "shard compile": ("shard_compile", compiled),
    "shard trainer": ("shard_trainer", trainer),
}
"""gpu_check's part name -> (its key in the figures, the function)."""


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "n/a"
    return format(v, spec)


def _ok(d: dict[str, Any]) -> str:
    return "ok" if d.get("ok") else "CHECK"


def rows(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """These parts' rows of gpu_check's table (parts that did not run have none)."""
    out: list[tuple[str, str, str]] = []
    if b := r.get("shard_bf16"):
        out += [
            (
                "shard bf16 loss max abs diff",
                _fmt(b["loss_max_abs"], ".2e"),
                f"vs plain bf16; {b['shards']} shards spilled; exact {b['exact']}; " + _ok(b),
            ),
            (
                "shard bf16 weight max abs diff",
                _fmt(b["weight_max_abs"], ".2e"),
                f"vs fp32 loss {_fmt(b['loss_vs_fp32_max_abs'], '.2e')} "
                f"(differs {b['differs_from_fp32']})",
            ),
        ]
    if f := r.get("shard_fp16"):
        for key in ("spilled", "resident"):
            if c := f.get(key):
                out.append(
                    (
                        f"shard fp16 scaler {key} diff",
                        _fmt(max(c["loss_max_abs"], c["weight_max_abs"]), ".2e"),
                        f"loss+weights; {c['shards']} shards; scales equal "
                        f"{c['scales_equal']}; {f['skipped_steps']} skipped; " + _ok(c),
                    )
                )
    if c := r.get("shard_compile"):
        out += [
            (
                f"shard compile step ratio ({c['backend']})",
                _fmt(c["step_ratio"]),
                f"sharded/plain s per step; {c['shards']} shards; first 2 steps "
                f"{_fmt(c['first_steps_s'])} s (plain {_fmt(c['plain_first_steps_s'])} s)",
            ),
            (
                "shard compile loss max abs diff",
                _fmt(c["loss_max_abs"], ".2e"),
                f"weights {_fmt(c['weight_max_abs'], '.2e')}; exact {c['exact']}; " + _ok(c),
            ),
        ]
    if t := r.get("shard_trainer"):
        if "skipped" in t:
            out.append(("shard Trainer", "skipped", t["skipped"]))
        else:
            out.append(
                (
                    "shard Trainer time ratio",
                    _fmt(t["time_ratio"]),
                    f"{t['steps']} logged losses equal {t['losses_equal']} (max abs "
                    f"{_fmt(t['loss_max_abs'], '.2e')}); " + _ok(t),
                )
            )
    return out
