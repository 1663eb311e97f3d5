#!/usr/bin/env bash
# The GPU checks for a short lent GPU machine (no network, minutes of device time, at most 10 minutes a
# command), in parts that each end well inside that; logs go to $OUT (default /tmp/tuneforge-gpu):
#
#   benchmarks/gpu_session.sh 1   versions, `make gpu-test`'s tests, the DeepSeek-V2-Lite step tables (<= 5.5 min)
#   benchmarks/gpu_session.sh 2   the Llama-3-8B step tables, the train run, the expert adapters (<= 5.5 min)
#   benchmarks/gpu_session.sh 3   loading a 4-bit MoE onto the GPU against staging it in host RAM (<= 2 min)
#   benchmarks/gpu_session.sh 4   vision-language: a ~126M-parameter LLaVA, tuneforge packed against unpacked (and
#                                 TRL's SFTTrainer where the machine has trl), 30 steps each: tokens/s, peak GPU
#                                 memory (<= 4 min)
#
# It uses the machine's own python3 and torch. What that lacks (pydantic, bitsandbytes, the peft version CI
# uses) travels as wheels in .whl/, which `benchmarks/gpu_wheels.sh` fills on a machine with network; .whl/
# is git-ignored, so the device tool's call must name it in `carry` (carry: [".whl"]). They are installed
# into /tmp/site, ahead of the machine's own packages.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:?usage: benchmarks/gpu_session.sh 1|2|3|4}"
OUT="${OUT:-/tmp/tuneforge-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
python3 -c "import pydantic, peft, transformers" || {
    echo "missing packages: fill .whl/ with benchmarks/gpu_wheels.sh and name .whl in the call's carry" >&2
    exit 1
}
{
    git log -1 --format='commit %h %cd' 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 -c '
import importlib.metadata as metadata
import torch
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for name in ("transformers", "peft", "bitsandbytes", "pydantic", "accelerate", "huggingface_hub", "tokenizers"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "missing")
'
} 2>&1 | tee "$OUT/versions-$PART.txt"
case "$PART" in
    1)
        timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-test.log"
        PYTHON=python3 PARTS="deepseek" benchmarks/gpu.sh 2>&1 | tee "$OUT/bench-1.log"
        ;;
    2)
        PYTHON=python3 PARTS="llama train experts" benchmarks/gpu.sh 2>&1 | tee "$OUT/bench-2.log"
        ;;
    3)
        timeout 110 python3 benchmarks/expert_staging.py --layers 3 2>&1 | tee "$OUT/staging.log"
        ;;
    4)
        # Pillow draws the corpus' pictures; TRL and datasets are optional (without them, tuneforge only).
        python3 -c "import PIL" || { echo "part 4 needs Pillow" >&2; exit 1; }
        timeout 230 python3 benchmarks/compare_trl_vlm.py --preset gpu --batch 16 --max-steps 30 \
            --workspace /tmp/tuneforge-vlm 2>&1 | tee "$OUT/vlm.log"
        ;;
    *)
        echo "part $PART: 1, 2, 3 or 4" >&2
        exit 2
        ;;
esac
