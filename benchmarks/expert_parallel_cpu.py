"""Full fine-tuning of a small DeepSeek-V2-architecture MoE on 2 CPU ranks (gloo) in three layouts, through
`tuneforge train` as users run it: DeepSpeed ZeRO-3 (every expert gathered on every rank per layer), DeepSpeed
ZeRO-2 with `parallel.expert_parallel: 2` (each rank holds half the experts; tokens are exchanged), and DDP (a
whole replica per rank).

    .venv/bin/python benchmarks/expert_parallel_cpu.py [--steps 12] [--experts 16] [--hidden 256]

Prints, per layout, the steady tokens/s (steps after the first two, from `metrics.jsonl`), the peak resident
memory per rank, the final loss, and the ratios against ZeRO-3 run by the same script. The two ranks share this
machine's cores, so the figures show the layouts' overheads relative to each other, not a multi-GPU speed-up;
the doctor's estimate (`tuneforge doctor ... --gpu h100`) gives GPU figures for real shapes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "deepspeed ZeRO-3": ["parallel.engine=deepspeed", "parallel.zero_stage=3"],
    "ZeRO-2 + expert_parallel 2": ["parallel.engine=deepspeed", "parallel.zero_stage=2", "parallel.expert_parallel=2"],
    "ddp": ["parallel.engine=ddp"],
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
    size = (
        f"{{hidden_size: {args.hidden}, intermediate_size: {2 * args.hidden}, "
        f"moe_intermediate_size: {args.hidden // 2}, "
        f"num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 4, n_routed_experts: {args.experts}, "
        "num_experts_per_tok: 2, n_shared_experts: 1, first_k_dense_replace: 1, kv_lora_rank: 32, q_lora_rank: null, "
        "qk_rope_head_dim: 16, qk_nope_head_dim: 32, v_head_dim: 32}"
    )
    config = directory / "job.yaml"
    config.write_text(
        f"model: {{architecture: deepseek_v2, tokenizer: bytes, size: {size}}}\n"
        "data: {train_files: [train.jsonl], max_length: 256, packing: true, cache_dir: null}\n"
        f"train: {{lr: 1.0e-3, micro_batch_size: 2, max_steps: {args.steps}, precision: fp32, warmup_steps: 0}}\n"
        "checkpoint: {every_steps: 0, save_final: false}\n"
        "log: {progress: lines, plot: false}\n"
    )
    return config


def run(config: Path, work_dir: Path, overrides: list[str]) -> dict[str, float]:
    # The launcher beside this interpreter (a virtual environment's bin/), else the one on PATH.
    beside = Path(sys.executable).parent / "tuneforge"
    launcher = str(beside) if beside.exists() else shutil.which("tuneforge") or "tuneforge"
    command = [launcher, "train", str(config), "--work-dir", str(work_dir)]
    command += ["--nproc-per-node", "2", *overrides]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tuneforge-ep-") as scratch:
        directory = Path(scratch)
        config = job(directory, args)
        results = {
            name: run(config, directory / f"run-{i}", overrides) for i, (name, overrides) in enumerate(LAYOUTS.items())
        }
    base = results["deepspeed ZeRO-3"]
    print(
        f"2 CPU ranks (gloo), DeepSeek-V2 architecture, hidden {args.hidden}, {args.experts} routed experts, "
        f"{args.steps} steps"
    )
    print(f"{'layout':<28} {'tokens/s':>9} {'x ZeRO-3':>9} {'peak RSS/rank':>14} {'x ZeRO-3':>9} {'final loss':>11}")
    for name, r in results.items():
        print(
            f"{name:<28} {r['tokens_per_s']:>9,.0f} {r['tokens_per_s'] / base['tokens_per_s']:>9.2f} "
            f"{r['peak_gb']:>12.2f}GB {r['peak_gb'] / base['peak_gb']:>9.2f} {r['loss']:>11.4f}"
        )


if __name__ == "__main__":
    main()
