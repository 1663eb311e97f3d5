"""LoRA throughput on one GPU: tuneforge's step against a plain `transformers` + PEFT loop, same model and data.

    python benchmarks/gpu_lora.py [--models deepseek_v2_lite,llama3_8b] [--steps 6] [--layers N]
    python benchmarks/gpu_lora.py --device cpu --smoke       # the same code on tiny shapes, for a CPU check

Models are built with random weights from the real configurations in `configs/models/` (DeepSeek-V2-Lite
with fewer layers when --layers is given; the per-layer figures are what matter). Both contenders train
LoRA r=64 on the same targets (tuneforge's default: every linear layer except routers and routed experts)
in bf16 on the same synthetic samples (log-normal lengths, median 300 tokens, up to 2,048), 16 samples per
step:

  transformers  the samples padded to the longest of each batch, loss from the model (`labels=`)
  tuneforge     the same samples packed into rows of 2,048 with attention kept inside each sample, the
                output layer fused with the loss (only positions with a target), through SingleEngine

Reported per contender: trained tokens/s (tokens carrying a label), all real tokens/s, MFU (6 x active
matmul parameters x real tokens / peak bf16 FLOP/s; the attention term left out, which favours no one),
peak GPU memory, and the ratios. The first two steps are warm-up and not timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from tuneforge.config.schema import LoraSettings
from tuneforge.data.batching import MicroBatch, best_fit_decreasing, collate
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.data.tokenize import TokenizedData
from tuneforge.engines.single import SingleEngine
from tuneforge.model.adapters import apply_lora
from tuneforge.model.moe import find_moe
from tuneforge.train.loop import accumulate_gradients
from tuneforge.train.optim import build_optimizer
from tuneforge.train.telemetry import active_matmul_parameters

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"
CONFIGS = {"deepseek_v2_lite": "deepseek-v2-lite-chat.config.json", "llama3_8b": "llama-3-8b.config.json"}
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
"""Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts)."""


def model_config(name: str, layers: int | None, smoke: bool):
    from transformers import AutoConfig

    fields = json.loads((MODELS / CONFIGS[name]).read_text())
    fields.pop("auto_map", None)  # the native transformers class, never remote code
    fields.pop("architectures", None)
    model_type = fields.pop("model_type")
    if smoke:
        fields.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
        fields.update(vocab_size=512, num_hidden_layers=2)
        if model_type == "deepseek_v2":
            fields.update(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32)
            fields.update(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=None)
    elif layers:
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type, **fields)


def synthetic_samples(count: int, vocab: int, max_length: int, seed: int = 0) -> TokenizedData:
    """Token ids with a prompt (no loss, 30%) and a reply (loss, 70%) per sample."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.6, count), 32, max_length).astype(int)
    samples = []
    for index, length in enumerate(lengths):
        ids = rng.integers(10, vocab, length)
        labels = ids.copy()
        labels[: int(length * 0.3)] = IGNORE_INDEX
        samples.append((ids, labels, f"synthetic:{index}"))
    return TokenizedData.from_samples(samples)


def build(config, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    moe = find_moe(model)  # on the base model, before adapters wrap it
    model, _ = apply_lora(model, LoraSettings(r=64, alpha=16, dropout=0.0), moe)
    return model, moe


def use_tuneforge_attention(model, device: torch.device) -> None:
    """What tuneforge's model builder does for `sdpa` on a GPU: per-sample SDPA for packed rows."""
    from tuneforge.model import packed_attention

    if device.type == "cuda":
        model.set_attn_implementation(packed_attention.register())


def tuneforge_batches(data: TokenizedData, per_step: int, max_length: int, pad: int) -> list[MicroBatch]:
    """Each step's samples packed into rows of max_length: one micro-batch per step."""
    batches = []
    for start in range(0, len(data) - per_step + 1, per_step):
        group = np.arange(start, start + per_step)
        rows = best_fit_decreasing(data.lengths[group], max_length)
        batches.append(collate(data, [[int(group[i]) for i in row] for row in rows], pad, packed=True))
    return batches


def padded_batches(data: TokenizedData, per_step: int, pad: int) -> list[MicroBatch]:
    return [
        collate(data, [[i] for i in range(start, start + per_step)], pad, packed=False)
        for start in range(0, len(data) - per_step + 1, per_step)
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_tuneforge(model, batches: list[MicroBatch], device: torch.device, warmup: int) -> list[tuple[float, int, int]]:
    engine = SingleEngine(model, lambda m: build_optimizer(m, train_settings()), None)
    steps = []
    for index, batch in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        accumulated = accumulate_gradients(engine, [batch], "bf16")
        engine.step(1e-4, 1.0)
        synchronize(device)
        if index >= warmup:
            steps.append((time.perf_counter() - start, accumulated.num_tokens, accumulated.num_targets))
    return steps


def run_transformers(model, batches: list[MicroBatch], device: torch.device, warmup: int):
    optimizer = build_optimizer(model, train_settings())
    steps = []
    for index, batch in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        # The labels transformers expects are the unshifted ids; MicroBatch.targets are already shifted.
        labels = torch.full_like(batch.targets, IGNORE_INDEX)
        labels[:, 1:] = batch.targets[:, :-1]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(
                input_ids=batch.input_ids.to(device),
                attention_mask=batch.attention_mask.to(device),
                labels=labels.to(device),
                use_cache=False,
            ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if index >= warmup:
            steps.append((time.perf_counter() - start, batch.num_tokens, batch.num_targets))
    return steps


def train_settings():
    from tuneforge.config.schema import TrainConfig

    return TrainConfig(lr=1e-4, precision="bf16")


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="deepseek_v2_lite,llama3_8b")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per contender (after 2 warm-up)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real number)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    warmup, per_step, max_length = 2, 16, 2048
    peak = peak_flops(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {where}; bf16 peak {peak / 1e12:.0f} TFLOP/s" if peak else f"device: {where}")
    for name in args.models.split(","):
        config = model_config(name, args.layers, args.smoke)
        data = synthetic_samples(per_step * (warmup + args.steps), config.vocab_size, max_length)
        results = {}
        for contender in ("transformers", "tuneforge"):
            model, moe = build(config, device)
            active = active_matmul_parameters(model, moe)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if contender == "tuneforge":
                use_tuneforge_attention(model.get_base_model(), device)
                batches = tuneforge_batches(data, per_step, max_length, config.pad_token_id or 0)
                steps = run_tuneforge(model, batches, device, warmup)
            else:
                steps = run_transformers(
                    model, padded_batches(data, per_step, config.pad_token_id or 0), device, warmup
                )
            seconds = sum(s for s, _, _ in steps)
            tokens, trained = sum(t for _, t, _ in steps), sum(t for _, _, t in steps)
            memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            results[contender] = {
                "trained_tokens_per_s": trained / seconds,
                "tokens_per_s": tokens / seconds,
                "mfu": 6 * active * tokens / seconds / peak if peak else float("nan"),
                "peak_memory_gib": memory,
            }
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        layers = config.num_hidden_layers
        print(f"\n== {name} ({layers} layers, {active / 1e9:.2f}B matmul parameters active per token), LoRA r=64")
        print(f"{'contender':<14}{'trained tok/s':>15}{'all tok/s':>12}{'MFU':>8}{'peak mem':>11}")
        for contender, r in results.items():
            print(
                f"{contender:<14}{r['trained_tokens_per_s']:>15,.0f}{r['tokens_per_s']:>12,.0f}"
                f"{r['mfu']:>8.1%}{r['peak_memory_gib']:>9.1f}GiB"
            )
        ours, base = results["tuneforge"], results["transformers"]
        speed = ours["trained_tokens_per_s"] / base["trained_tokens_per_s"]
        memory = ours["peak_memory_gib"] / base["peak_memory_gib"]
        print(f"tuneforge / transformers: trained tokens/s {speed:.2f}x, peak memory {memory:.2f}x")


if __name__ == "__main__":
    main()
