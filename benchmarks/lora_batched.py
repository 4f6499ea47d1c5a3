"""One shard's forward + backward for 8 LoRA trials over one frozen base: batched vs not.

Eight LoRA trials (rank, alpha and target modules differ) over one ``LlamaForCausalLM``
share its frozen tensors (as the engine's frozen pool makes them share). One shard of
decoder blocks runs a forward and a backward for every trial's batch, in two ways:

- **one after another**: each trial's shard alone (what the engine does today);
- **batched**: :class:`tune_hydra.engine.batched.BatchedShard`, one pass of the frozen
  layers over the concatenated batches, each trial's adapters on its own rows.

Rounds interleave the two (the order alternates), float32; the base is sized so that its
GEMMs dominate (hidden 768 by default: a block's frozen GEMMs are ``hidden x hidden``
and ``hidden x 2*hidden``, the adapters' ``hidden x r``). Reports samples/s of each and
the median of the per-round ratios.

Run: ``python benchmarks/lora_batched.py`` (``--tiny`` for the tests; ``--hidden``,
``--layers``, ``--trials``, ``--batch``, ``--seq``, ``--rounds`` to size it).
"""

from __future__ import annotations

import argparse
import statistics
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

    from tune_hydra.engine.frozen import canonical_name
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

    from tune_hydra.engine.batched import BatchedShard
    from tune_hydra.engine.boundary import backward, detach

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
    args = parser.parse_args(argv)
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
