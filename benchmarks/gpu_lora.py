"""LoRA throughput on one GPU: tuneforge's step against a plain `transformers` + PEFT loop, same model and data,
and a whole `tuneforge train` run beside tuneforge's step alone.

    python benchmarks/gpu_lora.py [--models deepseek_v2_lite,llama3_8b] [--steps 6] [--layers N]
    python benchmarks/gpu_lora.py --models deepseek_v2_lite --layers 4 --train-run   # the CLI against the step
    python benchmarks/gpu_lora.py --device cpu --smoke [--train-run]  # the same code on tiny shapes, on a CPU

Models are built with random weights from the real configurations in `src/tuneforge/recipes/models/` (all their layers
unless --layers is given). Both contenders train LoRA r=64 on the same targets (tuneforge's default: every
linear layer except routers and routed experts) in bf16 on the same synthetic samples (log-normal lengths,
median 300 tokens, up to 2,048; loss on the last 70% of each), 16 samples per optimizer step:

  tuneforge     the samples packed into rows of 2,048 with attention kept inside each sample, the output
                layer fused with the loss (only positions with a target), through SingleEngine (run first, so
                that a part cut off at its time limit still has it)
  transformers  the same samples padded to the longest of each micro-batch, loss from the model (`labels=`);
                all 16 in one micro-batch, or, where that runs out of memory, micro-batches of 8, 4, 2 or 1
                whose gradients accumulate (the table says which); SDPA limited to the backends tuneforge
                allows on CUDA (flash, memory-efficient, math), since cuDNN's per-shape plans would slow it

Per contender: trained tokens/s (tokens carrying a label), all real tokens/s, MFU and peak GPU memory, then
the ratios, the GPU's busy share of tuneforge's step (two more steps under torch.profiler), and the doctor's
estimate for the step, compared as positions computed per second, padding included, as the doctor counts.
MFU counts the FLOPs a LoRA step needs: 2 per active parameter forward and 2 for its input gradient, 2 more
for the adapters' own gradients (frozen weights get none), routed experts by their top-k share, attention
scores left out (`model.flops.model_flops_per_token`); "6N MFU" is the usual 6 x active parameters, for
figures quoted that way. Peaks come from
`tuneforge.estimate.hardware`. The first two steps are warm-up and not timed.

--train-run measures what a user gets instead: `tuneforge train` on the same architecture (a fresh model
of --layers layers, a local word-level tokenizer of the model's vocabulary, synthetic chats in the OpenAI
`messages` format, packing into 2,048, 3 rows per step), with its data pipeline, watchdog and logging, beside
tuneforge's step alone on that model. Its steady tokens/s comes from `metrics.jsonl` (steps after the first
two); the rest of its wall time is start-up, data, model building and saving.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tuneforge.config.schema import Config, DataConfig, LoraSettings, ModelConfig, TrainConfig
from tuneforge.data.batching import MicroBatch, best_fit_decreasing, collate
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.data.tokenize import TokenizedData
from tuneforge.engines import engine_traits
from tuneforge.engines.single import SingleEngine
from tuneforge.estimate import estimate
from tuneforge.estimate.hardware import ACCELERATORS, Accelerator, local_accelerator
from tuneforge.model.adapters import apply_lora
from tuneforge.model.flops import active_matmul_parameters, model_flops_per_token
from tuneforge.model.moe import find_moe
from tuneforge.recipes import MODEL_SHAPES
from tuneforge.train.loop import accumulate_gradients
from tuneforge.train.objectives import build_objective
from tuneforge.train.optim import build_optimizer

MODELS = MODEL_SHAPES
CONFIGS = {"deepseek_v2_lite": "deepseek-v2-lite-chat.config.json", "llama3_8b": "llama-3-8b.config.json"}
WARMUP, PER_STEP, MAX_LENGTH = 2, 16, 2048
LORA = LoraSettings(r=64, alpha=16, dropout=0.0)
PROFILED_STEPS = 2
"""Steps run again under torch.profiler after the timed ones, for the GPU's busy share."""
TRAIN_ROWS = 3
"""Rows of 2,048 per step in the train run: about the 16 samples per step of the step-only runs."""


def model_fields(name: str, layers: int | None, smoke: bool) -> tuple[str, dict]:
    """The model type and the config fields transformers' config class for it knows."""
    from transformers import AutoConfig

    fields = json.loads((MODELS / CONFIGS[name]).read_text())
    model_type = fields.pop("model_type")
    known = AutoConfig.for_model(model_type)
    fields = {key: value for key, value in fields.items() if hasattr(known, key) and key != "architectures"}
    if smoke:
        fields.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
        fields.update(vocab_size=512, num_hidden_layers=2, bos_token_id=1, eos_token_id=2)
        if model_type == "deepseek_v2":
            fields.update(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32)
            fields.update(qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=None)
    if layers:
        fields["num_hidden_layers"] = layers
    return model_type, fields


def model_config(model_type: str, fields: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields)


def synthetic_samples(count: int, vocab: int, seed: int = 0, typical: int = 300) -> list[np.ndarray]:
    """`count` samples of lengths spread around `typical` tokens (log-normal, as chat data is)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(typical), 0.6, count), 32, MAX_LENGTH).astype(int)
    return [rng.integers(10, vocab, length) for length in lengths]


def tokenized(samples: list[np.ndarray]) -> TokenizedData:
    """Each sample with a prompt (no loss, the first 30%) and a reply (loss, 70%)."""
    rows = []
    for index, ids in enumerate(samples):
        labels = ids.copy()
        labels[: int(len(ids) * 0.3)] = IGNORE_INDEX
        rows.append((ids, labels, f"synthetic:{index}"))
    return TokenizedData.from_samples(rows)


def build(config, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    moe = find_moe(model)  # on the base model, before adapters wrap it
    model, _ = apply_lora(model, LORA, moe)
    return model, moe


def use_tuneforge_attention(model) -> None:
    """What tuneforge's model builder does for `sdpa`: packed rows attend within each sample (on a GPU through
    the varlen kernel)."""
    from tuneforge.model import packed_attention

    model.set_attn_implementation(packed_attention.register())


def step_groups(count: int) -> list[list[int]]:
    return [list(range(start, start + PER_STEP)) for start in range(0, count - PER_STEP + 1, PER_STEP)]


def packed_batches(data: TokenizedData, pad: int) -> list[MicroBatch]:
    """Each step's samples packed into rows of 2,048: one micro-batch per step."""
    batches = []
    for group in step_groups(len(data)):
        rows = best_fit_decreasing(data.lengths[group], MAX_LENGTH)
        batches.append(collate(data, [[group[i] for i in row] for row in rows], pad, packed=True))
    return batches


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Measured:
    seconds: float
    tokens: int
    trained: int
    slots: int
    """Positions computed, padding included: what the doctor's tokens per step count."""
    peak_gib: float
    shape: str
    """How a step's samples were laid out."""
    busy: float | None = None
    """Share of a step's wall time the GPU was busy (tuneforge's step, from a profile)."""


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def run_tuneforge(model, batches: list[MicroBatch], device: torch.device, profiled: bool = True) -> Measured:
    engine = SingleEngine(model, lambda m: build_optimizer(m, train_settings()), None)
    objective = build_objective(engine, "bf16")
    seconds, tokens, trained, slots = 0.0, 0, 0, 0
    for index, batch in enumerate(batches):
        synchronize(device)
        start = time.perf_counter()
        accumulated = accumulate_gradients(engine, [batch], objective)
        engine.step(1e-4, 1.0)
        synchronize(device)
        if index >= WARMUP:
            seconds += time.perf_counter() - start
            tokens, trained = tokens + accumulated.num_tokens, trained + accumulated.num_targets
            slots += batch.input_ids.numel()
    rows = np.mean([b.input_ids.shape[0] for b in batches])
    layout = f"packed, {rows:.1f} rows of {MAX_LENGTH}"
    measured = Measured(seconds, tokens, trained, slots, peak_gib(device), layout)
    if profiled:
        measured.busy = busy_share(engine, batches[-PROFILED_STEPS:], device)
    return measured


def busy_share(engine: SingleEngine, batches: list[MicroBatch], device: torch.device) -> float | None:
    """Share of the wall time of a few more steps, under torch.profiler, in which the GPU ran kernels (or
    copies): the union of their spans over the steps' wall time. Only GPU activity is recorded, so that the
    host is not slowed by recording its own ops. None on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    objective = build_objective(engine, "bf16")
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        synchronize(device)
        start = time.perf_counter()
        for batch in batches:
            accumulate_gradients(engine, [batch], objective)
            engine.step(1e-4, 1.0)
        synchronize(device)
        wall = time.perf_counter() - start
    from torch.autograd import DeviceType

    spans = [
        (e.time_range.start, e.time_range.end)
        for e in profiler.events()
        # Annotations (e.g. the optimizer step's range) span idle gaps too: kernels and copies only.
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    return covered(spans) / 1e6 / wall


def covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) spans: kernels on several streams may overlap."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(spans):
        if end > reach:
            total += end - max(begin, reach)
            reach = end
    return total


def run_transformers(model, data: TokenizedData, pad: int, device: torch.device, micro: int) -> Measured:
    """Each step's 16 samples in micro-batches of `micro`, each padded to its longest; the loss of each is
    weighted by its share of the step's targets, so the gradient is the step's token mean."""
    optimizer = build_optimizer(model, train_settings())
    seconds, tokens, trained, slots = 0.0, 0, 0, 0
    for index, group in enumerate(step_groups(len(data))):
        chunks = [group[s : s + micro] for s in range(0, PER_STEP, micro)]
        batches = [collate(data, [[i] for i in chunk], pad, packed=False) for chunk in chunks]
        step_targets = sum(b.num_targets for b in batches)
        synchronize(device)
        start = time.perf_counter()
        for batch in batches:
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
            (loss * (batch.num_targets / step_targets)).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if index >= WARMUP:
            seconds += time.perf_counter() - start
            tokens += sum(b.num_tokens for b in batches)
            trained += step_targets
            slots += sum(b.input_ids.numel() for b in batches)
    steps = PER_STEP // micro
    shape = "padded, 1 micro-batch of 16" if steps == 1 else f"padded, {steps} micro-batches of {micro}"
    return Measured(seconds, tokens, trained, slots, peak_gib(device), shape)


def fit_transformers(model, data: TokenizedData, pad: int, device: torch.device) -> Measured:
    """The plain loop as a user would fit it: the whole step in one micro-batch, halved until it fits."""
    micro = PER_STEP
    while True:
        reset_peak(device)
        try:
            with backends(device):
                return run_transformers(model, data, pad, device, micro)
        except RuntimeError as error:  # torch.OutOfMemoryError, or cuBLAS/cuDNN failing to allocate
            if micro == 1 or not out_of_memory(error):
                raise
        # Outside the handler, so that the failed step's tensors are released with the exception.
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        micro //= 2
        print(f"  transformers: out of memory, trying micro-batches of {micro}", flush=True)


def out_of_memory(error: RuntimeError) -> bool:
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "ALLOC_FAILED" in text or "out of memory" in text


def backends(device: torch.device):
    """The SDPA backends tuneforge allows on CUDA, for the baseline too: left to choose, SDPA takes cuDNN on
    Hopper, which builds a plan for every new padded length and would make the baseline look slower than a
    plain loop needs to be."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel

    from tuneforge.model.packed_attention import CUDA_SDPA_BACKENDS

    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else nullcontext()


def train_settings() -> TrainConfig:
    return TrainConfig(lr=1e-4, precision="bf16")


def accelerator_here(device: torch.device) -> Accelerator:
    """This GPU as the estimate's table knows it; on a CPU the H200 (estimates only, for the smoke run)."""
    return (local_accelerator() if device.type == "cuda" else None) or ACCELERATORS["h200"]


def doctor_estimate(cfg: Config, config, accelerator: Accelerator) -> float | None:
    """The doctor's tokens/s for `cfg` on one GPU (its step time over its tokens per step)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    traits = engine_traits("single", cfg.parallel, cfg.train)
    result = estimate(cfg, skeleton, traits, 1, accelerator, find_moe(skeleton))
    return result.tokens_per_step / result.step_s if result.step_s else None


def step_config(model_type: str, fields: dict, rows: int) -> Config:
    """A job for the step-only runs, as the doctor reads one: `rows` packed rows of 2,048 per step."""
    model = ModelConfig(architecture=model_type, size=fields, tokenizer="bytes", dtype="bfloat16", lora=LORA)
    data = DataConfig(train_files=["synthetic.jsonl"], max_length=MAX_LENGTH, packing=True)
    return Config(model=model, data=data, train=TrainConfig(precision="bf16", micro_batch_size=rows))


def mfu(flops_per_token: float, tokens_per_s: float, accelerator: Accelerator, device: torch.device) -> str:
    if device.type != "cuda" or not accelerator.bf16_flops:
        return "n/a"
    return f"{flops_per_token * tokens_per_s / accelerator.bf16_flops:.1%}"


def gib(value: float) -> str:
    return "n/a" if np.isnan(value) else f"{value:.1f}GiB"


def print_row(name: str, m: Measured, flops: float, active: float, accelerator: Accelerator, device) -> None:
    rate = m.tokens / m.seconds
    print(
        f"{name:<14}{m.trained / m.seconds:>15,.0f}{rate:>12,.0f}{mfu(flops, rate, accelerator, device):>8}"
        f"{mfu(6 * active, rate, accelerator, device):>9}{gib(m.peak_gib):>12}  {m.shape}",
        flush=True,
    )


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compare(name: str, args, device: torch.device, accelerator: Accelerator) -> None:
    model_type, fields = model_fields(name, args.layers, args.smoke)
    config = model_config(model_type, fields)
    # The smoke run's samples are shorter: it checks the code, and the padded contender's rows cost seconds on a CPU.
    typical = 80 if args.smoke else 300
    data = tokenized(synthetic_samples(PER_STEP * (WARMUP + args.steps), config.vocab_size, typical=typical))
    pad = config.pad_token_id or 0
    results: dict[str, Measured] = {}
    header = f"{'contender':<14}{'trained tok/s':>15}{'all tok/s':>12}{'MFU':>8}{'6N MFU':>9}{'peak mem':>12}  layout"
    # tuneforge first: a part cut off at its time limit still has the row that matters.
    for contender in ("tuneforge", "transformers"):
        model, moe = build(config, device)
        flops, active = model_flops_per_token(model, moe), active_matmul_parameters(model, moe)
        if contender == "tuneforge":
            print(
                f"\n== {name} ({config.num_hidden_layers} layers, {active / 1e9:.2f}B matmul parameters active per "
                f"token with adapters), LoRA r={LORA.r}; the LoRA step needs {flops / 1e9:.2f} GFLOP per token"
            )
            print(header, flush=True)
        reset_peak(device)
        if contender == "tuneforge":
            use_tuneforge_attention(model.get_base_model())
            results[contender] = run_tuneforge(model, packed_batches(data, pad), device)
        else:
            results[contender] = fit_transformers(model, data, pad, device)
        print_row(contender, results[contender], flops, active, accelerator, device)
        del model, moe  # the map holds the MoE blocks: the experts too
        release(device)
    ours, base = results["tuneforge"], results["transformers"]
    speed = (ours.trained / ours.seconds) / (base.trained / base.seconds)
    memory = "" if device.type != "cuda" else f", peak memory {ours.peak_gib / base.peak_gib:.2f}x"
    print(f"tuneforge / transformers: trained tokens/s {speed:.2f}x{memory}")
    if ours.busy is not None:
        print(f"GPU busy in tuneforge's step: {ours.busy:.0%} of the wall time of {PROFILED_STEPS} profiled steps")
    rows = round(np.mean([b.input_ids.shape[0] for b in packed_batches(data, pad)]))
    predicted = doctor_estimate(step_config(model_type, fields, rows), config, accelerator)
    if predicted:
        print(
            f"doctor's estimate on {accelerator.name} for {rows} rows of {MAX_LENGTH} per step: {predicted:,.0f} "
            f"positions/s{against(ours.slots / ours.seconds, predicted, device)}"
        )


def against(measured: float, predicted: float, device: torch.device) -> str:
    """Both as positions computed per second, padding included: the doctor counts full rows."""
    if device.type != "cuda":
        return " (not compared: this is no GPU)"
    return f"; measured {measured:,.0f}, measured / estimate {measured / predicted:.2f}"


def local_tokenizer(vocab_size: int, directory: Path) -> None:
    """A word-level tokenizer with the model's vocabulary size: `w<id>` is token id, so synthetic text has
    exactly the lengths it is written with."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(special)}
    vocab.update({f"w{i}": i for i in range(len(special), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)


def write_chats(samples: list[np.ndarray], path: Path) -> None:
    with path.open("w") as out:
        for ids in samples:
            words = [f"w{i}" for i in ids]
            prompt = int(len(words) * 0.3)
            messages = [
                {"role": "user", "content": " ".join(words[:prompt])},
                {"role": "assistant", "content": " ".join(words[prompt:])},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")


def write_job(directory: Path, model_type: str, fields: dict, steps: int, device: torch.device) -> Path:
    import yaml

    size = {k: v for k, v in fields.items() if k not in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    job = {
        "model": {
            "architecture": model_type,
            "size": size,
            "tokenizer": str(directory / "tokenizer"),
            "dtype": "bfloat16",
            "lora": LORA.model_dump(include={"r", "alpha", "dropout"}),
        },
        "data": {
            "train_files": [str(directory / "chats.jsonl")],
            "max_length": MAX_LENGTH,
            "packing": True,
            "cache_dir": str(directory / "cache"),
        },
        "train": {
            "lr": 1e-4,
            "warmup_steps": 0,
            # bf16 on a GPU; on a CPU (the smoke run) fp32, which is fast there.
            "precision": "bf16" if device.type == "cuda" else "fp32",
            "micro_batch_size": TRAIN_ROWS,
            "max_steps": steps,
        },
        "checkpoint": {"every_steps": 0},
        "log": {"progress": "lines", "plot": False},
    }
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def steady_rate(records: list[dict]) -> tuple[float, float, float, int]:
    """Over the steps after warm-up: tokens/s and positions/s (padding included); seconds in all steps; how
    many steps were timed."""
    timed = records[WARMUP:] or records
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    slots = sum(r["tokens"] / (1 - r["padding"]) for r in timed)
    return tokens / seconds, slots / seconds, sum(r["tokens"] / r["tokens_per_s"] for r in records), len(timed)


def run_train_command(directory: Path, job: Path, timeout: float) -> tuple[list[dict] | None, float]:
    """`tuneforge train JOB` in its own process: the records of its metrics.jsonl (None if it failed, with
    its output printed) and its wall time."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    command = [sys.executable, "-m", "tuneforge", "train", str(job), "--work-dir", str(directory / "run")]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"") + (expired.stderr or b"")
        text = output.decode(errors="replace") if isinstance(output, bytes) else output
        print(f"tuneforge train: still running after {timeout:.0f} s, stopped; its output:\n{text[-3000:]}")
        return None, time.perf_counter() - start
    wall = time.perf_counter() - start
    metrics = directory / "run" / "metrics.jsonl"
    if done.returncode != 0 or not metrics.exists():
        print(f"tuneforge train failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        return None, wall
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if "tokens_per_s" in r], wall


def train_run(name: str, args, device: torch.device, accelerator: Accelerator) -> None:
    """The train run first (a part cut off at its time limit still has it), then the step alone."""
    from tuneforge.config.load import load_config

    model_type, fields = model_fields(name, args.layers, args.smoke)
    config = model_config(model_type, fields)
    steps = WARMUP + args.steps
    samples = synthetic_samples(PER_STEP * (steps + 2) * 2, config.vocab_size, seed=1)
    print(f"\n== {name} ({config.num_hidden_layers} layers), LoRA r={LORA.r}: `tuneforge train` against its step alone")
    with tempfile.TemporaryDirectory(prefix="tuneforge-train-run-") as scratch:
        directory = Path(scratch)
        local_tokenizer(config.vocab_size, directory / "tokenizer")
        write_chats(samples, directory / "chats.jsonl")
        job = write_job(directory, model_type, fields, steps, device)
        records, wall = run_train_command(directory, job, args.train_timeout)
        predicted = doctor_estimate(load_config(job), config, accelerator)
    if records is None:
        return
    rate, slot_rate, in_steps, timed = steady_rate(records)
    peak = records[-1].get("peak_memory_gb", float("nan"))
    print(
        f"tuneforge train:  {rate:>10,.0f} tokens/s over steps {WARMUP + 1}-{WARMUP + timed} "
        f"({TRAIN_ROWS} rows of {MAX_LENGTH} per step), peak {peak:.1f} GB",
        flush=True,
    )
    print(
        f"wall time {wall:.1f} s: {in_steps:.1f} s in {len(records)} steps, {wall - in_steps:.1f} s in start-up, "
        "data, model building and saving",
        flush=True,
    )
    if predicted:
        print(
            f"doctor's estimate on {accelerator.name} for this job: {predicted:,.0f} positions/s"
            + against(slot_rate, predicted, device),
            flush=True,
        )

    model, moe = build(config, device)
    use_tuneforge_attention(model.get_base_model())
    reset_peak(device)
    data = tokenized(samples[: PER_STEP * steps])
    alone = run_tuneforge(model, packed_batches(data, config.pad_token_id or 0), device, profiled=False)
    del model, moe
    release(device)
    print(f"step alone:       {alone.tokens / alone.seconds:>10,.0f} tokens/s ({alone.shape})")
    print(f"train / step alone: {rate / (alone.tokens / alone.seconds):.2f}x tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="deepseek_v2_lite,llama3_8b")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per contender (after 2 warm-up)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real number)")
    parser.add_argument("--train-run", action="store_true", help="`tuneforge train` against the step alone")
    parser.add_argument("--train-timeout", type=float, default=600.0, help="seconds the train run may take")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    accelerator = accelerator_here(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        known = f"bf16 peak {accelerator.bf16_flops / 1e12:.0f} TFLOP/s" if accelerator.bf16_flops else "peak unknown"
        print(f"device: {where}; {known}", flush=True)
    else:
        print(f"device: {where} (figures here check the code, not the speed)", flush=True)
    for name in args.models.split(","):
        if args.train_run:
            train_run(name, args, device, accelerator)
        else:
            compare(name, args, device, accelerator)


if __name__ == "__main__":
    main()
