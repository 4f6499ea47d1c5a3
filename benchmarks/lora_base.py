"""LoRA trials over one frozen base: host memory, device copies and throughput, shared vs not.

Eight LoRA trials (rank, alpha, learning rate and target modules differ) over one tiny
``LlamaForCausalLM``, each loaded by the trial with ``from_pretrained`` from a saved
checkpoint and wrapped with ``peft.get_peft_model``, as users write a fine-tuning search.
The engine (2 emulated copying CPU devices, a host budget above everything, so that the
host ledger counts) runs them with ``share_frozen=True`` and ``False``, each in a fresh
process, and reports:

- the host ledger (``held_bytes``) and the process's RSS growth with every trial
  registered, against the target ``B + trials x (adapter + gradients + AdamW state)``
  (B: the base's bytes);
- bytes copied to the devices per search step (one batch of every trial);
- samples per second over the training;
- RSS growth once every trial finished (left the engine), the users' models kept.

Run: ``python benchmarks/lora_base.py`` (``--tiny`` for the tests; ``--hidden``,
``--layers``, ``--trials``, ``--batches`` to size it; ``--host-mib`` for a host budget with
the disk tier below it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [["q_proj", "v_proj"], ["k_proj", "o_proj"], ["up_proj", "down_proj"], "all-linear"]


def rss() -> int:
    """The process's resident set size, bytes (after handing freed memory back)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def save_base(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random tiny Llama saved as a user's checkpoint; returns its parameter bytes."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def trial(folder: Path, i: int, batches: int, seq: int, vocab: int) -> Any:
    """Trial ``i`` as a factory writes it: load the base, wrap it with LoRA."""
    import peft
    import torch
    import transformers

    import tune_hydra as th

    base = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(i)
    cfg = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=[2, 4, 8, 16][i % 4],
        lora_alpha=[4, 8, 16, 32][(i + 1) % 4],
        target_modules=TARGETS[i % len(TARGETS)],
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(i)
    data = []
    for _ in range(batches):
        ids = torch.randint(1, vocab, (4, seq), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    lr = [1e-3, 3e-3, 1e-2, 3e-4][i % 4]
    return th.ModelTask(model, None, lambda p: torch.optim.AdamW(p, lr=lr), data)


def one(args: argparse.Namespace, share: bool) -> dict[str, Any]:
    """One engine run (in this process): the figures of ``share``."""
    # Imported before the first measurement: their code is not the trials' memory.
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import tune_hydra as th  # noqa: F401
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    folder = Path(args.folder)
    base_bytes = int(args.base_bytes)
    rss0 = rss()
    with (
        tempfile.TemporaryDirectory() as spill,
        Engine(
            ["cpu", "cpu"],
            copy_on_cpu=True,
            max_layers_per_shard=args.cut,
            # 64 GiB is never reached: the ledger counts, nothing is spilled.
            host_memory=int(args.host_mib * 2**20) if args.host_mib else 64 * 2**30,
            spill_dir=spill,
            share_frozen=share,
            policy="lrtf",
        ) as eng,
    ):
        own = 0
        models = []  # the users' models: kept after their trials finish, as users do
        loops = []
        for i in range(args.trials):
            task = trial(folder, i, args.batches, args.seq, args.vocab)
            trainable = sum(
                p.numel() * p.element_size() for p in task.model.parameters() if p.requires_grad
            )
            own += 4 * trainable  # weights, gradients, AdamW's two moments
            loops.append(TaskLoop(f"t{i}", task, eng, seed=i))
            loops[-1].cut()  # registered now (its states in the host ledger), not at batch 1
            models.append(task.model)
            del task
        registered = rss()
        held = eng.summary()["host"]["held_bytes"]
        t0 = time.perf_counter()
        futures = [loop.start(1) for loop in loops]
        for f in futures:
            f.result(timeout=3600)
        wall = time.perf_counter() - t0
        trained = rss()
        copied = sum(e.bytes_moved for e in eng.trace.events if e.op == "copy_in")
        spilled = sum(e.bytes_moved for e in eng.trace.events if e.op == "copy_out")
        host = eng.summary()["host"]
        peak = host["peak_held_bytes"]
        # All trials finish (leave the engine), their models kept: shared, a finished
        # model reads the pool's base until the user writes it (no copy per trial).
        for loop in loops:
            loop.close()
        del loops  # the loops go; the users' models stay
        finished = rss()
    samples = args.trials * args.batches * 4
    return {
        "share": share,
        "base_bytes": base_bytes,
        "target": base_bytes + own,
        "held": held,
        "peak_held": peak,
        "rss_growth": registered - rss0,
        "rss_growth_trained": trained - rss0,
        "rss_growth_finished": finished - rss0,
        "copied_per_step": copied / args.batches,
        "copied_back_per_step": spilled / args.batches,
        "samples_per_s": samples / wall,
        "written_per_step": host["written_bytes"] / args.batches,
        "read_per_step": host["read_bytes"] / args.batches,
        "wall_s": wall,
    }


def mib(n: float) -> str:
    return f"{n / 2**20:9.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run (the tests)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--cut", type=int, default=2, help="max_layers_per_shard")
    parser.add_argument(
        "--host-mib", type=float, help="host_memory in MiB (default: never reached)"
    )
    parser.add_argument("--one", choices=["shared", "unshared"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--base-bytes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.vocab, args.trials, args.batches, args.seq = (
            32,
            2,
            200,
            3,
            2,
            8,
        )
    if args.one is not None:
        print(json.dumps(one(args, args.one == "shared")))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        base = save_base(Path(folder), args.hidden, args.layers, args.vocab)
        for mode in ("shared", "unshared"):
            cmd = [sys.executable, __file__, "--one", mode, "--folder", folder]
            cmd += ["--base-bytes", str(base), "--hidden", str(args.hidden)]
            cmd += ["--layers", str(args.layers), "--vocab", str(args.vocab)]
            cmd += ["--trials", str(args.trials), "--batches", str(args.batches)]
            cmd += ["--seq", str(args.seq), "--cut", str(args.cut)]
            if args.host_mib:
                cmd += ["--host-mib", str(args.host_mib)]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            if proc.returncode:
                print(proc.stdout, proc.stderr, file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    s, u = rows
    print(
        f"lora_base: {args.trials} LoRA trials over one Llama base of B = {mib(base).strip()} "
        f"(hidden {args.hidden}, {args.layers} layers), 2 emulated copying devices"
    )
    print(f"target B + trials x (adapter + grads + AdamW): {mib(s['target'])}")
    if args.host_mib:
        print(f"host_memory: {args.host_mib} MiB (the disk tier below it)")
    print(f"{'':28}{'shared':>14}{'not shared':>14}{'ratio':>8}")
    for label, key in (
        ("host ledger, registered", "held"),
        ("host ledger, peak", "peak_held"),
        ("RSS growth, registered", "rss_growth"),
        ("RSS growth, after training", "rss_growth_trained"),
        ("RSS growth, all finished", "rss_growth_finished"),
        ("copied to devices per step", "copied_per_step"),
        ("copied back per step", "copied_back_per_step"),
        ("written to disk per step", "written_per_step"),
        ("read from disk per step", "read_per_step"),
    ):
        print(f"{label:28}{mib(s[key])}{mib(u[key])}{u[key] / max(1, s[key]):7.2f}x")
    print(
        f"{'samples/s':28}{s['samples_per_s']:14.1f}{u['samples_per_s']:14.1f}"
        f"{s['samples_per_s'] / u['samples_per_s']:7.2f}x"
    )
    for label, key in (("host ledger", "held"), ("RSS growth", "rss_growth")):
        print(
            f"{label} / target: shared {s[key] / s['target']:.2f}, "
            f"not shared {u[key] / u['target']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
