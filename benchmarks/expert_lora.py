"""Adapters on routed experts: PEFT's full-size W + B·A against tuneforge's grouped low-rank products.

    .venv/bin/python benchmarks/expert_lora.py [--tokens 512] [--steps 3] [--layers 1] [--rank 64]

One DeepSeek-V2-Lite layer with the real MoE shapes (hidden 2048, 64 routed experts of 1408, top-6, 2 shared;
MLA attention; a 1,024-token vocabulary so the head costs little), random weights, LoRA r=64 on every linear
layer. Four contenders, each in its own process so that peak memory is its own:
  - `no expert adapters`: `model.lora.experts: false` (the floor);
  - `experts, PEFT form`: adapters on the stacked experts as PEFT computes them (`grouped_experts: false`);
  - `experts, grouped`: the same adapters as grouped low-rank products (tuneforge's default);
  - `4-bit experts, grouped`: the same, with the stacked experts stored in NF4 with double quantization as
    QLoRA stores them (the other weights stay as they are, to isolate the experts).
It prints the median time of a forward and backward over one row of `--tokens` tokens after one warm-up,
tokens/s, peak memory during those steps (CUDA: allocated; CPU: the process's resident set, its high-water
mark reset after set-up), the ratios against the PEFT form, and the largest difference between the two
forms' logits (the same adapter weights in both). fp32 on CPU, bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time

import torch

CONTENDERS = {
    "no expert adapters": {"experts": False},
    "experts, PEFT form": {"experts": True, "grouped_experts": False},
    "experts, grouped": {"experts": True, "grouped_experts": True},
    "4-bit experts, grouped": {"experts": True, "grouped_experts": True, "quantize_experts": True},
}


def model_config(layers: int):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=1024,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=4096,
    )


def build(layers: int, rank: int, lora: dict, device: str, dtype: torch.dtype):
    from transformers import DeepseekV2ForCausalLM

    from tuneforge.config.schema import LoraSettings, ModelConfig
    from tuneforge.model.moe import find_moe
    from tuneforge.model.trainable import make_trainable

    torch.manual_seed(0)
    config = model_config(layers)
    with torch.device(device):
        model = DeepseekV2ForCausalLM(config).to(dtype)
    lora = dict(lora)
    if lora.pop("quantize_experts", False):
        from tuneforge.config.schema import QuantizationConfig
        from tuneforge.model.quantized_experts import quantize_stacked_experts

        quantize_stacked_experts(model, QuantizationConfig(bits=4, compute_dtype=str(dtype).split(".")[-1]), dtype)
    settings = LoraSettings(r=rank, alpha=2 * rank, dropout=0.0, **lora)
    model, notes = make_trainable(
        model, ModelConfig(architecture="llama", tokenizer="bytes", lora=settings), False, find_moe(model)
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the same non-zero adapters in every contender
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    return model, notes[-1]


def estimated_delta_seconds(args: argparse.Namespace) -> tuple[float, str]:
    """The doctor's time for forming W + B·A in PEFT's form, for one forward and backward of this row, and the
    accelerator it assumed (this GPU where the table knows it, else an H200)."""
    from transformers import DeepseekV2ForCausalLM

    from tuneforge.config.schema import Config, DataConfig, LoraSettings, ModelConfig, TrainConfig
    from tuneforge.engines import engine_traits
    from tuneforge.estimate import estimate
    from tuneforge.estimate.hardware import ACCELERATORS, local_accelerator
    from tuneforge.model.moe import find_moe

    with torch.device("meta"):
        skeleton = DeepseekV2ForCausalLM(model_config(args.layers))
    lora = LoraSettings(r=args.rank, alpha=2 * args.rank, dropout=0.0, experts=True, grouped_experts=False)
    cfg = Config(
        model=ModelConfig(architecture="deepseek_v2", tokenizer="bytes", dtype="bfloat16", lora=lora),
        data=DataConfig(train_files=["unused.jsonl"], max_length=args.tokens),
        train=TrainConfig(precision="bf16", micro_batch_size=1),
    )
    accelerator = local_accelerator() or ACCELERATORS["h200"]
    result = estimate(
        cfg, skeleton, engine_traits("single", cfg.parallel, cfg.train), 1, accelerator, find_moe(skeleton)
    )
    times = {what: seconds for what, seconds, _ in result.times}
    return times.get("expert adapter deltas", 0.0), accelerator.name


def worker(args: argparse.Namespace) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, note = build(args.layers, args.rank, CONTENDERS[args.contender], device, dtype)
    ids = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(2)).to(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as refs:  # Linux: the resident high-water mark starts again here
            refs.write("5")
    times, logits = [], None
    for _ in range(args.steps + 1):
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        logits = out.logits.detach()
    torch.save(logits.float().cpu(), args.logits)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        with open("/proc/self/status") as status_file:
            status = dict(line.split(":", 1) for line in status_file.read().splitlines())
        peak = int(status["VmHWM"].split()[0]) * 1024
    step = statistics.median(times[1:])
    print(json.dumps({"step_s": step, "peak": peak, "note": note, "device": device}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--contender", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--logits", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        worker(args)
        return

    results, logits = {}, {}
    for index, name in enumerate(CONTENDERS):
        if CONTENDERS[name].get("quantize_experts") and importlib.util.find_spec("bitsandbytes") is None:
            print(f"{name}: skipped (bitsandbytes is not installed)", flush=True)
            continue
        path = f"/tmp/expert_lora_logits_{index}.pt"
        command = [sys.executable, __file__, "--contender", name, "--logits", path]
        command += ["--tokens", str(args.tokens), "--steps", str(args.steps), "--layers", str(args.layers)]
        command += ["--rank", str(args.rank)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        logits[name] = torch.load(path)
        print(f"{name}: {results[name]['note']}", flush=True)

    device = results["experts, grouped"]["device"]
    print(
        f"\nDeepSeek-V2-Lite MoE shapes, {args.layers} layer(s), LoRA r={args.rank} on every linear layer, "
        f"one row of {args.tokens} tokens, forward + backward, {device}, torch {torch.__version__}\n"
    )
    print("| contender | step | tokens/s | peak memory | step vs PEFT form | memory vs PEFT form |")
    print("|---|---:|---:|---:|---:|---:|")
    baseline = results["experts, PEFT form"]
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s'] * 1e3:,.0f} ms | {args.tokens / r['step_s']:,.0f} | "
            f"{r['peak'] / 2**30:.2f} GiB | {r['step_s'] / baseline['step_s']:.2f} | "
            f"{r['peak'] / baseline['peak']:.2f} |"
        )
    predicted, accelerator = estimated_delta_seconds(args)
    measured = baseline["step_s"] - results["experts, grouped"]["step_s"]
    compared = f"; measured (PEFT form - grouped) {measured * 1e3:,.0f} ms" if device == "cuda" else " (no GPU here)"
    print(f"\ndoctor's estimate of forming W + B·A on {accelerator}: {predicted * 1e3:,.0f} ms{compared}")
    difference = (logits["experts, grouped"] - logits["experts, PEFT form"]).abs().max().item()
    print(f"largest |logit difference| grouped vs PEFT form: {difference:.2e}")
    if "4-bit experts, grouped" not in logits:
        return
    error = (logits["4-bit experts, grouped"] - logits["experts, grouped"]).abs().max().item()
    scale = logits["experts, grouped"].abs().max().item()
    print(f"largest |logit difference| 4-bit experts vs full precision: {error:.2e} (NF4; |logits| <= {scale:.2f})")


if __name__ == "__main__":
    main()
