"""One shard's forward + backward for 8 LoRA trials over one frozen base: batched vs not.

Eight LoRA trials (rank, alpha and target modules differ) over one ``LlamaForCausalLM``
share its frozen tensors (as the engine's frozen pool makes them share). One shard of
decoder blocks runs a forward and a backward for every trial's batch, in two ways:

- **one after another**: each trial's shard alone (what the engine does today);
- **batched**: :class:`tune_hydra.engine.dispatch.batched.BatchedShard`, one pass of the frozen
  layers over the concatenated batches, each trial's adapters on its own rows.

Rounds interleave the two (the order alternates), float32; the base is sized so that its
GEMMs dominate (hidden 768 by default: a block's frozen GEMMs are ``hidden x hidden``
and ``hidden x 2*hidden``, the adapters' ``hidden x r``). Reports samples/s of each and
the median of the per-round ratios.

``--engine``: the same 8 trials through the engine instead (a ``lora_base.py``-style
search: a Llama of hidden 256, 6 layers, vocab 4000 saved and loaded with
``from_pretrained``, AdamW, 4 batches of 4 x 32 tokens, one epoch; 2 emulated copying
CPU devices, ``max_layers_per_shard=2``), ``Engine(batch_shared=True)`` vs ``False``,
each run in a fresh process, the two interleaved: samples/s and the batched passes.
Each trial is a ``ModelTask`` trained as the front ends train one: a ``TaskLoop``
(a ``th.shard`` loop, one train batch one op through every shard), all cut before any
trains.

``--loops``: the same engine search, each trial a user's loop under ``th.shard`` (one
thread each, the model's own loss, AdamW; ``zero_grad``, ``backward``, ``step``: a
forward op and a backward op per shard).

Run: ``python benchmarks/lora_batched.py`` (``--tiny`` for the tests; ``--hidden``,
``--layers``, ``--trials``, ``--batch``, ``--seq``, ``--rounds`` to size it;
``--engine`` for the engine's figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

TARGETS = [["q_proj", "v_proj"], ["k_proj", "o_proj"], ["up_proj", "down_proj"], "all-linear"]


def build(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """The trials' block shards (frozen tensors shared) and each trial's shard input."""
    import copy

    import peft
    import torch
    import transformers
    from torch import nn

    from tune_hydra.engine.storage.frozen import canonical_name
    from tune_hydra.models import peft_layers

    config = transformers.LlamaConfig(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_attention_heads=8 if args.hidden % 8 == 0 else 4,
        num_key_value_heads=8 if args.hidden % 8 == 0 else 4,
        vocab_size=args.vocab,
        max_position_embeddings=max(64, args.seq),
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).float()
    shards, inputs = [], []
    pool: dict[str, torch.Tensor] = {}
    for i in range(args.trials):
        torch.manual_seed(i)
        cfg = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=[2, 4, 8, 16][i % 4],
            lora_alpha=[4, 8, 16, 32][(i + 1) % 4],
            target_modules=TARGETS[i % len(TARGETS)],
            lora_dropout=0.0,
        )
        model = peft.get_peft_model(copy.deepcopy(base), cfg).train()
        for name, p in model.named_parameters():  # one base, as the frozen pool holds it
            if not p.requires_grad:
                p.data = pool.setdefault(canonical_name(name), p.data)
        stages = [m for _, m in peft_layers(model)]
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=g)
        with torch.no_grad():
            carry = stages[0]({"input_ids": ids, "labels": ids})
        shards.append(nn.Sequential(*stages[1 : 1 + args.layers]))
        inputs.append(carry)
    return shards, inputs


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils._pytree import tree_map

    from tune_hydra.engine.dispatch.batched import BatchedShard
    from tune_hydra.engine.runtime.boundary import backward

    def detach(obj: Any, requires_grad: bool) -> Any:  # a shard's input, a leaf
        return tree_map(
            lambda t: (
                t.detach().requires_grad_(requires_grad and t.is_floating_point())
                if isinstance(t, torch.Tensor)
                else t
            ),
            obj,
        )

    shards, inputs = build(args)
    batched = BatchedShard(shards)
    g = torch.Generator().manual_seed(7)
    grads = []
    for s, x in zip(shards, inputs, strict=True):  # the next shard's: the hidden state's
        with torch.no_grad():
            out = s(x)
        nothing = tree_map(lambda _: None, out)
        grads.append((torch.randn(out[0].shape, generator=g), *nothing[1:]))
    params = [p for s in shards for p in s.parameters() if p.requires_grad]

    def one_by_one() -> None:
        for s, x, gr in zip(shards, inputs, grads, strict=True):
            inp = detach(x, requires_grad=True)
            backward(s(inp), gr)

    def together() -> None:
        leaves = [detach(x, requires_grad=True) for x in inputs]
        run = batched.forward(leaves)
        BatchedShard.backward(run, grads)

    times: dict[str, list[float]] = {"alone": [], "batched": []}
    runs = {"alone": one_by_one, "batched": together}
    for name in runs:  # warm-up
        runs[name]()
    for r in range(args.rounds):
        order = ["alone", "batched"] if r % 2 == 0 else ["batched", "alone"]
        for name in order:
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    samples = args.trials * args.batch
    alone_s = statistics.median(times["alone"])
    batched_s = statistics.median(times["batched"])
    base_bytes = sum(
        p.numel() * p.element_size() for p in shards[0].parameters() if not p.requires_grad
    )
    return {
        "trials": args.trials,
        "shard_frozen_bytes": base_bytes,
        "alone_samples_per_s": samples / alone_s,
        "batched_samples_per_s": samples / batched_s,
        "ratio": statistics.median(
            a / b for a, b in zip(times["alone"], times["batched"], strict=True)
        ),
        "threads": torch.get_num_threads(),
    }


def engine_run(args: argparse.Namespace, batched: bool) -> dict[str, Any]:
    """One engine search (in this process): the trials of ``args.folder``, one epoch, as
    task factories (each a ``TaskLoop``), or with ``--loops`` as users' ``th.shard`` loops
    (one thread each, as ``study.optimize(n_jobs=...)`` runs them)."""
    import peft
    import torch
    import transformers

    import tune_hydra as th
    from tune_hydra.engine import Engine
    from tune_hydra.frontends.task_loop import TaskLoop

    tasks = []
    together = _Start(args.trials)
    for i in range(args.trials):
        base = transformers.LlamaForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
        torch.manual_seed(i)
        cfg = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=[2, 4, 8, 16][i % 4],
            lora_alpha=[4, 8, 16, 32][(i + 1) % 4],
            target_modules=TARGETS[i % len(TARGETS)],
            lora_dropout=0.0,
        )
        g = torch.Generator().manual_seed(i)
        data = []
        for _ in range(args.batches):
            ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=g)
            data.append({"input_ids": ids, "labels": ids.clone()})
        lr = [1e-3, 3e-3, 1e-2, 3e-4][i % 4]
        model = peft.get_peft_model(base, cfg)
        train: Any = _Together(data, together) if args.tiny and not args.loops else data
        tasks.append(th.ModelTask(model, None, lambda p, lr=lr: torch.optim.AdamW(p, lr=lr), train))
    with Engine(
        ["cpu", "cpu"],
        copy_on_cpu=True,
        max_layers_per_shard=args.cut,
        policy="lrtf",
        batch_shared=batched,
    ) as eng:
        loops: list[TaskLoop] = []
        if args.loops:
            wall = _run_loops(eng, tasks)
        else:
            # Each task trained as the front ends train a ModelTask: a TaskLoop, all cut
            # (registered, their frozen bases shared) before any trains.
            loops = [TaskLoop(f"t{i}", task, eng, seed=i) for i, task in enumerate(tasks)]
            for loop in loops:
                loop.cut()
            t0 = time.perf_counter()
            together.armed = True
            futures = [loop.start(1) for loop in loops]
            for f in futures:
                f.result(timeout=3600)
            wall = time.perf_counter() - t0
        copied = sum(e.bytes_moved for e in eng.trace.events if e.op == "copy_in")
        passes = eng.batcher.passes if eng.batcher is not None else 0
        ops = eng.batcher.batched_ops if eng.batcher is not None else 0
        for loop in loops:
            loop.close()
    return {
        "batched": batched,
        "samples_per_s": args.trials * args.batches * args.batch / wall,
        "copied_per_step": copied / args.batches,
        "passes": passes,
        "batched_ops": ops,
    }


class _Start:
    """``--tiny`` (the tests, often on a loaded machine): the trials' batches start
    together, so that their ops on the shared base are ready at once and the engine's
    batching is exercised whatever else the machine runs (left to chance, a loaded run
    sometimes had no batched pass). Armed after the cuts (each probes its first batch)."""

    def __init__(self, trials: int) -> None:
        self.barrier = threading.Barrier(trials)
        self.armed = False


class _Together:
    """A trial's batches, each yielded once every trial asks for its own (``_Start``)."""

    def __init__(self, data: list[Any], start: _Start) -> None:
        self.data, self.start = data, start

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Any:
        for batch in self.data:
            if self.start.armed:
                # One trial failed (the barrier broke): the others go on alone.
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.start.barrier.wait(timeout=30)
            yield batch


def _run_loops(eng: Any, tasks: list[Any]) -> float:
    """Each task's model trained by a user's loop under ``th.shard`` on ``eng``, one
    thread each; the seconds from the first ``th.shard`` to the last loop's end."""
    import threading

    import torch

    import tune_hydra as th

    errors: list[BaseException] = []
    start = threading.Barrier(len(tasks) + 1)

    def loop(i: int) -> None:
        task = tasks[i]
        model = task.model
        opt = task.optimizer([p for p in model.parameters() if p.requires_grad])
        torch.manual_seed(i)
        model, opt = th.shard(model, opt, engine=eng)
        start.wait()
        try:
            for batch in task.train_data:
                opt.zero_grad()
                model(**batch).loss.backward()
                opt.step()
            th.unshard(model)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(tasks))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def engine_main(args: argparse.Namespace) -> int:
    """``--engine``: batch_shared on vs off, each in a fresh process, interleaved (``--tiny``:
    in this one)."""
    import torch
    import transformers

    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as folder:
        config = transformers.LlamaConfig(
            num_hidden_layers=args.layers,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=args.vocab,
            max_position_embeddings=max(64, args.seq),
        )
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        for r in range(args.rounds):
            for batched in (False, True) if r % 2 == 0 else (True, False):
                if args.tiny:  # the tests: the same runs in this process (no figures read)
                    args.folder = folder
                    runs[batched].append(engine_run(args, batched))
                    continue
                cmd = [sys.executable, __file__, "--one-engine", str(int(batched))]
                cmd += ["--folder", folder, "--trials", str(args.trials)]
                cmd += ["--batches", str(args.batches), "--batch", str(args.batch)]
                cmd += ["--seq", str(args.seq), "--vocab", str(args.vocab)]
                cmd += ["--cut", str(args.cut)] + ["--loops"] * args.loops
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                runs[batched].append(json.loads(out.strip().splitlines()[-1]))
    kind = "th.shard loops (a thread each)" if args.loops else "task factories"
    print(
        f"engine, {kind}: {args.trials} LoRA trials, Llama hidden {args.hidden}, {args.layers} "
        f"layers, {args.batches} batches of {args.batch} x {args.seq} tokens, 2 emulated "
        f"copying CPU devices, max_layers_per_shard={args.cut}, float32"
    )
    for batched in (False, True):
        rs = runs[batched]
        sps = ", ".join(f"{x['samples_per_s']:.1f}" for x in rs)
        mib = ", ".join(f"{x['copied_per_step'] / 2**20:.0f}" for x in rs)
        label = "batch_shared=True " if batched else "batch_shared=False"
        extra = f"; {rs[0]['passes']} batched passes of {rs[0]['batched_ops']} ops" * batched
        print(f"{label}: samples/s {sps}; copied per step {mib} MiB{extra}")
    ratio = statistics.median(
        b["samples_per_s"] / a["samples_per_s"]
        for a, b in zip(runs[False], runs[True], strict=True)
    )
    print(f"engine batched / not: {ratio:.2f}x (median of {args.rounds} pairs)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long run (the tests)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--engine", action="store_true", help="the engine's figures")
    parser.add_argument("--batches", type=int, default=4, help="--engine: batches per trial")
    parser.add_argument("--cut", type=int, default=2, help="--engine: max_layers_per_shard")
    parser.add_argument(
        "--loops", action="store_true", help="--engine: the trials as th.shard loops"
    )
    parser.add_argument("--one-engine", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_engine is not None:
        print(json.dumps(engine_run(args, args.one_engine == "1")))
        return 0
    if args.engine or args.loops:
        if args.tiny:
            # 4 batches a trial: loops' ops batch only while every device is busy, which
            # 2 batches left to chance (about 1 run in 7 had no batched pass).
            args.hidden, args.layers, args.vocab, args.trials = 32, 2, 100, 3
            args.batches, args.batch, args.seq, args.rounds = 4, 2, 8, 1
        else:  # lora_base.py's search, unless sized otherwise
            args.hidden = 256 if args.hidden == 768 else args.hidden
            args.layers = 6 if args.layers == 2 else args.layers
            args.vocab = 4000 if args.vocab == 1000 else args.vocab
            args.batch = 4 if args.batch == 2 else args.batch
            args.seq = 32 if args.seq == 64 else args.seq
            args.rounds = 2 if args.rounds == 6 else args.rounds
        return engine_main(args)
    if args.tiny:
        args.hidden, args.layers, args.vocab, args.trials, args.batch, args.seq = (
            32,
            1,
            100,
            3,
            2,
            8,
        )
        args.rounds = 2
    f = measure(args)
    print(
        f"{f['trials']} LoRA trials, one shard of {args.layers} Llama block(s), hidden "
        f"{args.hidden}, batch {args.batch} x {args.seq} tokens per trial, float32, "
        f"{f['threads']} torch threads; frozen shard {f['shard_frozen_bytes'] / 2**20:.1f} MiB"
    )
    print(f"one after another: {f['alone_samples_per_s']:10.1f} samples/s")
    print(f"batched:           {f['batched_samples_per_s']:10.1f} samples/s")
    rounds = f"median of {args.rounds} rounds' ratios"
    print(f"batched / one after another: {f['ratio']:.2f}x ({rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
