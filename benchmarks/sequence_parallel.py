"""Activation memory per rank and tokens/s for long samples, with each sample split across N ranks.

    .venv/bin/python benchmarks/sequence_parallel.py [--lengths 8192 32768] [--sizes 1 2] [--hidden 64]

For each length L and size N, one Llama-architecture model (random weights, byte vocabulary) trains on one row
holding one sample of L tokens: N = 1 in one process, N > 1 under `torchrun --nproc-per-node N` through
tuneforge's own sharding (`shard_rows`), inputs (`model_inputs`) and loss (`TokenForward`), gloo on CPU or NCCL
on GPUs. Per rank it reports the bytes autograd keeps for backward (the activations: every tensor saved by a
forward, counted once per storage), the process's peak resident memory, and the step time (median of the
timed steps after one warm-up). Tokens/s counts the whole row once, over all ranks. The ratios are against
N = 1 at the same length, in the same script. On a CPU the ranks share its cores (each gets cores / N threads),
so tokens/s shows the cost of the exchange, not a speed-up; the memory halving is what N = 2 buys there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.data.batching import MicroBatch, shard_rows
from tuneforge.distributed import Layout
from tuneforge.model import packed_attention, sequence_parallel
from tuneforge.objective import TokenForward


def whole_row(length: int, vocab: int) -> MicroBatch:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, length), generator=generator)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    positions = torch.arange(length)[None, :]
    return MicroBatch(ids, torch.ones_like(ids), targets, positions, torch.zeros_like(ids), True, ["bench"])


def saved_bytes(step) -> tuple[int, object]:
    """Bytes autograd saves for backward during `step()` (each storage once), and what `step` returned."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = step()
    return sum(storages.values()), result


def worker(args: argparse.Namespace) -> None:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    if size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        sequence_parallel.init_groups(rank, size, size)
    layout = Layout.of(rank, size, size)
    torch.manual_seed(0)
    heads = args.hidden // 16
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=args.length,
    )
    model = LlamaForCausalLM(config).to(device)
    model.set_attn_implementation(packed_attention.register())
    batch = shard_rows(whole_row(args.length, 256), layout.shard, layout.size)
    precision = "bf16" if device.type == "cuda" else "fp32"
    forward = TokenForward(model, model, precision)
    times, activations = [], 0
    for step in range(1 + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        activations, loss = saved_bytes(lambda: forward.cross_entropy_sum(batch))
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    report = {
        "rank": rank,
        "activations": activations,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times),
    }
    reports = [report]
    if size > 1:
        reports = [None] * size
        dist.all_gather_object(reports, report)
        dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(reports))


def measure(length: int, size: int, args: argparse.Namespace) -> list[dict]:
    script = [os.path.abspath(__file__), "--worker", "--length", str(length)]
    script += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps)]
    threads = max(1, (os.cpu_count() or 1) // size)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if size == 1:
        command = [sys.executable, *script]
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        command = [torchrun, "--nproc-per-node", str(size), "--master-port", str(29700 + size), *script]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"N={size}, L={length} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--length", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print(
        f"Llama-architecture, hidden {args.hidden}, {args.hidden // 16} heads of 16, {args.layers} layers, one sample "
        f"per row; {os.cpu_count()} CPU(s), torch {torch.__version__}"
    )
    print(
        f"{'tokens':>7} {'N':>3} {'activations/rank':>17} {'ratio':>6} {'peak RSS/rank':>14} {'step s':>7} {'tok/s':>8}"
    )
    for length in args.lengths:
        baseline = None
        for size in args.sizes:
            reports = measure(length, size, args)
            activations = max(r["activations"] for r in reports)
            peak = max(r["peak_rss"] for r in reports)
            step = max(r["step_s"] for r in reports)
            baseline = baseline or activations
            print(
                f"{length:>7} {size:>3} {activations / 2**20:>13.1f} MiB {activations / baseline:>6.2f} "
                f"{peak / 2**20:>10.0f} MiB {step:>7.2f} {length / step:>8.0f}"
            )


if __name__ == "__main__":
    main()
