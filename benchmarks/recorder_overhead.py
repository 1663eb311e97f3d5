"""Cost of the hang watchdog's collective recorder, against the same work without it, in one process.

    .venv/bin/python benchmarks/recorder_overhead.py [--hidden 512] [--layers 8] [--seq 256] [--batch 4]

Two parts: (1) the recorder's own cost per collective call, timed on a one-rank gloo group (the transport is
then nearly free, so the difference is the wrapper); (2) the cost of module tracking (global forward hooks)
on a forward and backward of a Llama-architecture model. The overhead per step is then estimated for FSDP2,
which issues about three collectives per decoder layer per step (all-gather in forward, again in backward,
reduce-scatter), and printed as a fraction of the measured step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.diagnostics.recorder import CollectiveRecorder


def bookkeeping_per_call(calls: int) -> tuple[float, float]:
    """Seconds the recorder itself spends per collective (record + done) and per module (enter + leave)."""
    recorder = CollectiveRecorder()
    tensor = torch.zeros(1024)
    start = time.perf_counter()
    for _ in range(calls):
        recorder.done(recorder.record("all_reduce", (tensor,), {}))
    per_collective = (time.perf_counter() - start) / calls
    module = torch.nn.Linear(2, 2)
    recorder._names = {id(module): "layer"}
    start = time.perf_counter()
    for _ in range(calls):
        recorder._enter(module, ())
        recorder._leave(module, (), None)
    return per_collective, (time.perf_counter() - start) / calls


def time_collectives(calls: int, rounds: int) -> tuple[float, float]:
    """Median seconds per all_reduce without and with the recorder, in alternating rounds (noise hits both)."""
    tensor = torch.zeros(1024)
    recorder = CollectiveRecorder()
    plain, recorded = [], []
    for _ in range(rounds):
        for samples in (plain, recorded):
            if samples is recorded:
                recorder.install()
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor)
            samples.append((time.perf_counter() - start) / calls)
            recorder.uninstall()
    return statistics.median(plain), statistics.median(recorded)


def time_steps(model: torch.nn.Module, batch: torch.Tensor, rounds: int) -> tuple[float, float]:
    """Median seconds of a forward and backward without and with module tracking, alternating."""
    recorder = CollectiveRecorder()
    plain, tracked = [], []
    model(input_ids=batch, labels=batch).loss.backward()  # warm-up
    for _ in range(rounds):
        for samples in (plain, tracked):
            if samples is tracked:
                recorder.track_modules(model)
            start = time.perf_counter()
            model(input_ids=batch, labels=batch).loss.backward()
            samples.append(time.perf_counter() - start)
            recorder.uninstall()
    return statistics.median(plain), statistics.median(tracked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()

    per_call, per_module = bookkeeping_per_call(args.calls)
    print(f"recorder bookkeeping: {per_call * 1e6:.2f} us per collective, {per_module * 1e6:.2f} us per module call")
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(store, 'store')}", rank=0, world_size=1)
        plain_call, recorded_call = time_collectives(args.calls // 10, rounds=10)
        dist.destroy_process_group()
    print(
        f"all_reduce on 1 gloo rank (A/B, median of 10 rounds): {plain_call * 1e6:.1f} us plain, "
        f"{recorded_call * 1e6:.1f} us recorded (ratio {recorded_call / plain_call:.3f})"
    )

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
    )
    model = LlamaForCausalLM(config)
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    plain_step, tracked_step = time_steps(model, batch, args.repeats)
    modules = sum(1 for _ in model.modules())
    print(
        f"forward+backward, {parameters:.0f}M-parameter Llama, batch {args.batch} x {args.seq} (A/B, median of "
        f"{args.repeats}): {plain_step:.3f}s plain, {tracked_step:.3f}s with module tracking "
        f"(ratio {tracked_step / plain_step:.3f})"
    )
    collectives = 3 * args.layers + 4
    estimated = collectives * per_call + modules * per_module
    print(
        f"bookkeeping per FSDP2 step ({collectives} collectives, {modules} module calls): {estimated * 1e3:.3f} ms "
        f"= {100 * estimated / plain_step:.3f}% of the step"
    )


if __name__ == "__main__":
    main()
