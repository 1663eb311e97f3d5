#!/usr/bin/env bash
# LoRA throughput on one GPU (H200/H100/A100), no network: tuneforge against plain transformers + PEFT.
#
#   benchmarks/gpu.sh [WHEEL_DIR]
#
# WHEEL_DIR holds the wheels to install offline (torch for the GPU's CUDA, transformers, peft, and their
# dependencies; `pip download -d wheels torch transformers peft ...` on a machine with network). Without it
# the current Python environment is used as it is. Prints, each part cut off at its time limit, at most 490 s in all:
#   - benchmarks/gpu_lora.py on a DeepSeek-V2-Lite-architecture model (random weights, real dimensions, all 27
#     layers) and a Llama-3-8B-architecture model (all 32 layers): tuneforge's step against transformers + PEFT;
#   - benchmarks/gpu_lora.py --train-run: a whole `tuneforge train` run (CLI, data pipeline, watchdog, logging)
#     on DeepSeek-V2-Lite's architecture with 4 layers, beside tuneforge's step alone on the same model;
#   - benchmarks/expert_lora.py: adapters on DeepSeek-V2-Lite's routed experts, PEFT's full-size W + B·A
#     against grouped low-rank products, and on 4-bit experts;
#   - part `ep`, on a node with several GPUs only (not in the default parts: the lent machine has one):
#     benchmarks/expert_parallel_cpu.py on DeepSeek-V2-Lite's shapes (4 layers, full fine-tuning, bf16) over
#     every GPU: ZeRO-3, ZeRO-2 with expert parallelism, DDP.
# Every part prints the doctor's estimate beside what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-}"
PYTHON="${PYTHON:-python3}"
if [[ -n "$WHEELS" ]]; then
    "$PYTHON" -m venv .venv-gpu
    .venv-gpu/bin/pip install -q --no-index --find-links "$WHEELS" torch transformers peft safetensors pydantic pyyaml rich matplotlib
    # bitsandbytes only for expert_lora.py's 4-bit contender, which is skipped without it.
    .venv-gpu/bin/pip install -q --no-index --find-links "$WHEELS" bitsandbytes || echo "no bitsandbytes wheel"
    .venv-gpu/bin/pip install -q --no-index --find-links "$WHEELS" --no-deps -e .
    PYTHON=.venv-gpu/bin/python
fi
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# PARTS picks some of the parts (default: deepseek llama train experts; ep needs several GPUs).
PARTS=" ${PARTS:-deepseek llama train experts} "
if [[ "$PARTS" == *" deepseek "* ]]; then
    timeout 170 "$PYTHON" benchmarks/gpu_lora.py --models deepseek_v2_lite --steps 4 || echo "(cut off or failed)"
fi
if [[ "$PARTS" == *" llama "* ]]; then
    timeout 130 "$PYTHON" benchmarks/gpu_lora.py --models llama3_8b --steps 4 || echo "(cut off or failed)"
fi
if [[ "$PARTS" == *" train "* ]]; then
    timeout 110 "$PYTHON" benchmarks/gpu_lora.py --models deepseek_v2_lite --layers 4 --steps 8 --train-run \
        --train-timeout 75 || echo "(cut off or failed)"
fi
if [[ "$PARTS" == *" experts "* ]]; then
    timeout 80 "$PYTHON" benchmarks/expert_lora.py --layers 2 --tokens 4096 --steps 3 || echo "(cut off or failed)"
fi
if [[ "$PARTS" == *" ep "* ]]; then
    GPUS=$(nvidia-smi -L | wc -l)
    if (( GPUS < 2 )); then
        echo "ep: needs several GPUs; this machine has $GPUS"
    else
        # The doctor's name for this GPU (h100, h200, a100, ...), for its estimate beside each layout.
        GPU_KEY=$("$PYTHON" -c "import torch; from tuneforge.estimate.hardware import GIB, accelerator_key
p = torch.cuda.get_device_properties(0); print(accelerator_key(p.name, p.total_memory / GIB) or 'h100')")
        timeout 600 "$PYTHON" benchmarks/expert_parallel_cpu.py --ranks "$GPUS" --layers 4 --length 4096 --steps 8 \
            --shapes src/tuneforge/recipes/models/deepseek-v2-lite-chat.config.json --precision bf16 \
            --gpu "$GPU_KEY" || echo "(cut off or failed)"
    fi
fi
