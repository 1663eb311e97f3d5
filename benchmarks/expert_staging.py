"""Loading a 4-bit MoE: onto the GPU (`stage_experts: device`) against staged in host RAM (`host`).

    .venv/bin/python benchmarks/expert_staging.py [--model deepseek_v2_lite] [--layers 6]

Needs a CUDA GPU. Writes a model of the named architecture from `tuneforge.recipes.MODEL_SHAPES` (random bf16
weights, real dimensions, `--layers` of its layers) to a temporary directory, then loads it once per mode with
tuneforge's loader (QLoRA settings: NF4, double quantization, bf16 compute), each in a fresh process, and prints
the load time, the peak GPU memory allocated, the process's peak resident set, and the ratios host / device.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tuneforge.recipes import MODEL_SHAPES

MODELS = MODEL_SHAPES
CONFIGS = {"deepseek_v2_lite": "deepseek-v2-lite-chat.config.json", "mixtral_8x7b": "mixtral-8x7b.config.json"}
MODES = ("device", "host")


def write_model(name: str, layers: int, directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads((MODELS / CONFIGS[name]).read_text())
    fields.pop("auto_map", None)
    fields.pop("architectures", None)
    fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)


def load(directory: Path, mode: str) -> dict:
    """One load in this process: seconds, peak GPU bytes allocated, peak resident bytes."""
    from tuneforge.config.schema import LoraSettings, ModelConfig, QuantizationConfig
    from tuneforge.model.build import _load
    from tuneforge.model.quantized_experts import quantized_experts_count

    settings = QuantizationConfig(bits=4, compute_dtype="bfloat16", stage_experts=mode)
    cfg = ModelConfig(path=str(directory), dtype="bfloat16", quantization=settings, lora=LoraSettings())
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = _load(str(directory), cfg, device, sharded_engine=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "gpu": torch.cuda.max_memory_allocated(),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "quantized_experts": quantized_experts_count(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(CONFIGS), default="deepseek_v2_lite")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--child", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load(Path(args.child[0]), args.child[1])))
        return
    if not torch.cuda.is_available():
        sys.exit("expert_staging.py: needs a CUDA GPU (staging in host RAM only differs from a load onto a GPU)")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        write_model(args.model, args.layers, Path(tmp))
        print(f"{args.model}, {args.layers} layers, written in {time.perf_counter() - started:.0f} s")
        results = {}
        for mode in MODES:
            child = [sys.executable, __file__, "--child", tmp, mode]
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
    print(f"{'stage_experts':<14}{'load s':>8}{'peak GPU GiB':>14}{'peak RSS GiB':>14}{'4-bit experts':>15}")
    for mode, r in results.items():
        print(
            f"{mode:<14}{r['seconds']:>8.1f}{r['gpu'] / 2**30:>14.2f}{r['rss'] / 2**30:>14.2f}"
            f"{r['quantized_experts']:>15}"
        )
    host, device = results["host"], results["device"]
    print(
        f"host / device: time x{host['seconds'] / device['seconds']:.2f}, peak GPU x{host['gpu'] / device['gpu']:.2f}, "
        f"peak RSS x{host['rss'] / device['rss']:.2f}"
    )


if __name__ == "__main__":
    main()
