"""Full fine-tuning of a DeepSeek-V2-architecture MoE on N ranks in three layouts, through `tuneforge train` as
users run it: DeepSpeed ZeRO-3 (every expert gathered on every rank per layer), DeepSpeed ZeRO-2 with
`parallel.expert_parallel: N` (each rank holds 1/N of the experts; tokens are exchanged), and DDP (a whole
replica per rank).

    .venv/bin/python benchmarks/expert_parallel_cpu.py [--steps 12] [--experts 16] [--hidden 256]
    python benchmarks/expert_parallel_cpu.py --ranks 8 --shapes MODELS/deepseek-v2-lite-chat.config.json \
        --layers 4 --precision bf16 --gpu h100

(MODELS: src/tuneforge/recipes/models; the second form on a node with 8 GPUs, `benchmarks/gpu.sh` part `ep`.)

Prints, per layout, the steady tokens/s (steps after the first two, from `metrics.jsonl`), the peak memory per
rank (GPU peak allocated on GPUs, resident memory on CPU), the final loss, and the ratios against ZeRO-3 run by
the same script; with `--gpu NAME`, the doctor's estimate of the same job's step time and memory per GPU beside
them. On CPU the ranks share this machine's cores, so the figures show the layouts' overheads relative to each
other, not a multi-GPU speed-up. `--shapes` takes a model's real dimensions from its config.json (the vocabulary
stays the byte tokenizer's), `--layers` keeps that many decoder layers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def layouts(ranks: int, experts: int) -> dict[str, list[str]]:
    """ZeRO-3, ZeRO-2 with the experts over the most ranks that divide both counts, and DDP."""
    size = max(n for n in range(1, ranks + 1) if ranks % n == 0 and experts % n == 0)
    return {
        "deepspeed ZeRO-3": ["parallel.engine=deepspeed", "parallel.zero_stage=3"],
        f"ZeRO-2 + expert_parallel {size}": [
            "parallel.engine=deepspeed",
            "parallel.zero_stage=2",
            f"parallel.expert_parallel={size}",
        ],
        "ddp": ["parallel.engine=ddp"],
    }


SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)


def model_size(args: argparse.Namespace) -> dict:
    """The `model.size` of the job: a small model from the flags, or a real model's dimensions (`--shapes`)."""
    if args.shapes:
        real = json.loads(Path(args.shapes).read_text())
        return {**{key: real[key] for key in SHAPE_KEYS if key in real}, "num_hidden_layers": args.layers}
    return {
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "moe_intermediate_size": args.hidden // 2,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": args.experts,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    }


def job(directory: Path, args: argparse.Namespace) -> Path:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i} " * 8},
                {"role": "assistant", "content": f"{i * 7} " * 15},
            ]
        }
        for i in range(400)
    ]
    (directory / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    size = json.dumps(model_size(args))  # YAML reads JSON
    config = directory / "job.yaml"
    config.write_text(
        f"model: {{architecture: deepseek_v2, tokenizer: bytes, size: {size}}}\n"
        f"data: {{train_files: [train.jsonl], max_length: {args.length}, packing: true, cache_dir: null}}\n"
        f"train: {{lr: 1.0e-3, micro_batch_size: 2, max_steps: {args.steps}, precision: {args.precision}, "
        "warmup_steps: 0}\n"
        "checkpoint: {every_steps: 0, save_final: false}\n"
        "log: {progress: lines, plot: false}\n"
    )
    return config


def launcher() -> str:
    # The launcher beside this interpreter (a virtual environment's bin/), else the one on PATH.
    beside = Path(sys.executable).parent / "tuneforge"
    return str(beside) if beside.exists() else shutil.which("tuneforge") or "tuneforge"


def run(config: Path, work_dir: Path, ranks: int, overrides: list[str]) -> dict[str, float]:
    command = [launcher(), "train", str(config), "--work-dir", str(work_dir)]
    command += ["--nproc-per-node", str(ranks), *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"{' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").open()]
    steady = records[2:] or records
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady),
        "peak_gb": max(r["peak_memory_gb"] for r in records),
        "loss": records[-1]["loss"],
    }


def doctor_estimate(config: Path, ranks: int, gpu: str, overrides: list[str]) -> str:
    """The doctor's step time and memory per GPU for the job under `overrides`, as it prints them."""
    command = [launcher(), "doctor", str(config), "--nproc-per-node", str(ranks), "--gpu", gpu, *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    found = {}
    for line in result.stdout.splitlines():
        for check in ("memory estimate", "time estimate"):  # e.g. `PASS  time estimate   3.2 s per step, ...`
            if check in line:
                found[check] = line.split(check, 1)[1].strip().split(",")[0]
    if len(found) < 2:
        last = (result.stderr or result.stdout).strip().splitlines()
        return f"(no estimate from the doctor: {last[-1] if last else 'no output'})"
    return f"{found['time estimate']}, {found['memory estimate'].split(' (')[0]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=256, help="packed row length (data.max_length)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--shapes", help="a model's config.json: its real dimensions, --layers of its layers")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--gpu", help="print the doctor's estimate for this GPU (h100, a100, ...) beside each")
    args = parser.parse_args()
    experts = model_size(args)["n_routed_experts"]
    shapes = f"shapes of {Path(args.shapes).name}, {args.layers} layers" if args.shapes else f"hidden {args.hidden}"
    print(
        f"{args.ranks} ranks, DeepSeek-V2 architecture ({shapes}), {experts} routed experts, {args.precision}, "
        f"{args.steps} steps"
    )
    print(f"{'layout':<28} {'tokens/s':>9} {'x ZeRO-3':>9} {'peak/rank':>11} {'x ZeRO-3':>9} {'final loss':>11}")
    with tempfile.TemporaryDirectory(prefix="tuneforge-ep-") as scratch:
        directory = Path(scratch)
        config = job(directory, args)
        base = None
        for i, (name, overrides) in enumerate(layouts(args.ranks, experts).items()):
            # Each layout's line as soon as it ran: a benchmark cut off by its time limit keeps what it measured.
            r = run(config, directory / f"run-{i}", args.ranks, overrides)
            base = base or r  # ZeRO-3 runs first
            line = (
                f"{name:<28} {r['tokens_per_s']:>9,.0f} {r['tokens_per_s'] / base['tokens_per_s']:>9.2f} "
                f"{r['peak_gb']:>9.2f}GB {r['peak_gb'] / base['peak_gb']:>9.2f} {r['loss']:>11.4f}"
            )
            if args.gpu:
                line += f"   doctor ({args.gpu}): {doctor_estimate(config, args.ranks, args.gpu, overrides)}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
