"""tuneforge against Hugging Face TRL's SFTTrainer: same model, data, batch, learning rate, steps, precision.

    .venv/bin/pip install trl            # benchmark-only dependency
    .venv/bin/python benchmarks/compare_trl.py [--models dense,moe] [--steps 6] [--precision fp32]

One invocation builds a workspace (a randomly initialised Llama-architecture model of about 52M
parameters and a small DeepseekV2 MoE, saved once and loaded by every contender; a synthetic
single-turn chat corpus whose lengths follow a log-normal with median about 300 tokens and a tail
to max_length 1024), measures this CPU's fp32 matmul peak, then runs each contender in its own
process (so peak RSS is its own):

  trl-padding   SFTTrainer defaults: batches of 8 samples padded to the longest
  trl-wrapped   SFTTrainer packing_strategy="wrapped": rows of 1024, samples attend to each other
  trl-bfd       (only with --bfd) TRL's default packing, padding-free: FlashAttention territory
  tuneforge     packed rows of 1024 with attention kept within each sample
  tuneforge-compile  (only with --compile) the same with train.compile=true

Every contender trains the same number of optimizer steps with 8 rows (or samples) per step, a
constant learning rate, AdamW, clipping at 1.0, and a loss on the assistant reply only (TRL's
prompt-completion format, tuneforge's messages with the same chat template rendered as Jinja).
Throughput counts steps 2..N (step 1 carries one-off warm-up). The tokenizer is byte-level (one
token per byte) and the models embed 32,000 tokens, so the output layer costs what a real
vocabulary's does.

MFU: model FLOPs per trained step are 6 x matmul parameters (MoE: those active per token) x tokens
plus causal attention, 6 x 2 x layers x attention width x the mean attended context per token, the
context being each sample for padding and tuneforge and each 1024-token row for wrapped packing (from
the corpus' length distribution). Divided by the fp32 (or bf16) matmul peak, measured once at the start
for reference and again in each contender's process right after its steps: MFU is against the latter,
since a shared VM's speed drifts over the minutes a run takes; MFU@best is against the highest peak
measured in the invocation (the conservative figure). Model FLOPs count the output layer on every token,
as the usual definition does, while tuneforge runs it only on tokens that carry a label; exec@best
counts it only where it runs (all tokens for TRL, labelled ones for tuneforge), over the same best peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

VOCAB = 32_000
ROWS = 8
WORDS = [
    "the",
    "a",
    "model",
    "token",
    "data",
    "train",
    "loss",
    "rank",
    "step",
    "batch",
    "layer",
    "expert",
    "router",
    "adapter",
    "weight",
    "chat",
    "reply",
    "gradient",
    "optimizer",
    "schedule",
    "checkpoint",
    "memory",
    "kernel",
    "attention",
    "sequence",
]
CONTENDERS = ("trl-padding", "trl-wrapped", "tuneforge")


# ---------------------------------------------------------------- workspace


def text_of(rng: np.random.Generator, length: int) -> str:
    words = rng.choice(WORDS, size=length // 4 + 2)
    return " ".join(words)[:length]


def make_corpus(directory: Path, samples: int, max_length: int, seed: int = 0) -> None:
    """The same conversations twice: OpenAI `messages` for tuneforge, prompt/completion for TRL."""
    rng = np.random.default_rng(seed)
    # The template adds about 60 bytes per conversation; keep every sample under max_length.
    sizes = np.clip(rng.lognormal(mean=np.log(300), sigma=0.6, size=samples), 40, max_length - 80).astype(int)
    with (directory / "messages.jsonl").open("w") as messages, (directory / "prompt.jsonl").open("w") as prompts:
        for size in sizes:
            user = {"role": "user", "content": text_of(rng, max(8, int(size * 0.3)))}
            assistant = {"role": "assistant", "content": text_of(rng, max(8, int(size * 0.7)))}
            messages.write(json.dumps({"messages": [user, assistant]}) + "\n")
            prompts.write(json.dumps({"prompt": [user], "completion": [assistant]}) + "\n")


def save_tokenizer(directory: Path):
    from tuneforge.data.byte_tokenizer import build_byte_tokenizer
    from tuneforge.data.jinja_template import to_jinja
    from tuneforge.data.templates import get_template

    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = to_jinja(get_template("qwen_chat"), None)
    tokenizer.save_pretrained(directory)
    return tokenizer


def dense_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def moe_config(tokenizer):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1408,
        moe_intermediate_size=352,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=128,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_workspace(root: Path, models: list[str], samples: int, max_length: int) -> None:
    from transformers import AutoModelForCausalLM

    make_corpus(root, samples, max_length)
    for name in models:
        directory = root / name
        tokenizer = save_tokenizer(directory)
        config = dense_config(tokenizer) if name == "dense" else moe_config(tokenizer)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def matmul_peak(dtype: torch.dtype, seconds: float = 3.0) -> float:
    """Best FLOP/s of large square matmuls on this CPU with the threads torch uses."""
    best = 0.0
    for size in (1024, 2048, 3072):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        out = a @ b
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            torch.matmul(a, b, out=out)  # the kernel's rate, not the allocator's: no fresh output pages
            runs += 1
        best = max(best, 2 * size**3 * runs / (time.perf_counter() - start))
    return best


def context_per_token(root: Path, max_length: int, wrapped: bool) -> float:
    """Mean number of keys a token attends to (causal): (n+1)/2 averaged over tokens of sequences of length n."""
    if wrapped:
        return (max_length + 1) / 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "dense" if (root / "dense").exists() else root / "moe")
    lengths = []
    for line in (root / "messages.jsonl").open():
        text = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
        lengths.append(len(text.encode()))
    n = np.array(lengths, dtype=np.float64)
    return float((n * (n + 1) / 2).sum() / n.sum())


# ---------------------------------------------------------------- contenders


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def run_trl(
    root: Path,
    model: str,
    strategy: str,
    steps: int,
    lr: float,
    precision: str,
    max_length: int,
    checkpointing: bool = False,
) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    directory = root / model
    tokenizer = AutoTokenizer.from_pretrained(directory)
    network = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    dataset = load_dataset("json", data_files=str(root / "prompt.jsonl"), split="train")
    packing = strategy != "padding"
    args = SFTConfig(
        output_dir=str(root / f"out-{model}-trl-{strategy}"),
        max_length=max_length,
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=precision == "bf16",
        packing=packing,
        packing_strategy=strategy if packing else "bfd",
        completion_only_loss=True,
        # SFTConfig turns activation checkpointing on by default; here both contenders run with the same setting,
        # off unless --activation-checkpointing (before 2026-12-07 TRL ran with it and tuneforge without).
        gradient_checkpointing=checkpointing,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    batches: list[tuple[int, int, int]] = []  # (real tokens, trained tokens, positions computed) per batch

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.ends:
                self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    timer = Timer()
    trainer = SFTTrainer(model=network, args=args, train_dataset=dataset, processing_class=tokenizer)
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        labels = batch["labels"]
        if "attention_mask" in batch:
            tokens = int(batch["attention_mask"].sum())
        else:  # padding-free rows carry position_ids and no padding
            tokens = int(labels.numel())
        batches.append((tokens, int((labels[:, 1:] != -100).sum()), int(labels.numel())))
        return batch

    trainer.data_collator = counting_collator
    trainer.add_callback(timer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    durations = np.diff(timer.ends)
    return summarize(batches[:steps], list(durations), losses, output_layer_on_labels=False)


def run_tuneforge(
    root: Path,
    model: str,
    steps: int,
    lr: float,
    precision: str,
    max_length: int,
    compiled: bool = False,
    checkpointing: bool = False,
) -> dict:
    from tuneforge.config.schema import Config
    from tuneforge.train.run import run_training

    work_dir = root / f"out-{model}-tuneforge{'-compile' if compiled else ''}"
    shutil.rmtree(work_dir, ignore_errors=True)  # a reused workspace's earlier run
    cfg = Config.model_validate(
        {
            "model": {"path": str(root / model), "dtype": "float32"},
            "data": {
                "train_files": [str(root / "messages.jsonl")],
                "template": "qwen_chat",
                "max_length": max_length,
                "packing": True,
                "cache_dir": None,
            },
            "train": {
                "lr": lr,
                "schedule": "constant",
                "warmup_steps": 0,
                "micro_batch_size": ROWS,
                "gradient_accumulation": 1,
                "max_steps": steps,
                "max_grad_norm": 1.0,
                "precision": precision,
                "seed": 0,
                "compile": compiled,
                "gradient_checkpointing": checkpointing,
            },
            "checkpoint": {"every_steps": 0, "save_final": False},
            "log": {"progress": "lines", "plot": False},
        }
    )
    run_training(cfg, work_dir)
    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").open()]
    batches = [(r["tokens"], r["trained_tokens"], round(r["tokens"] / (1 - r["padding"]))) for r in records]
    durations = [r["tokens"] / r["tokens_per_s"] for r in records]
    # The fused loss applies the output layer to labelled positions only (a plain, untied head here).
    return summarize(batches, durations, [r["loss"] for r in records], output_layer_on_labels=True)


def summarize(
    batches: list[tuple[int, int, int]], durations: list[float], losses: list[float], output_layer_on_labels: bool
) -> dict:
    """`output_layer_on_labels`: the contender applies the output layer only to tokens that carry a label."""
    timed = slice(1, len(durations))  # step 1 carries one-off warm-up
    seconds = float(sum(durations[timed]))
    tokens = sum(b[0] for b in batches[timed])
    trained = sum(b[1] for b in batches[timed])
    slots = sum(b[2] for b in batches[timed])
    return {
        "padding": 1 - tokens / slots,
        "steps": len(durations),
        "seconds": seconds,
        "tokens": tokens,
        "trained_tokens": trained,
        "tokens_per_s": tokens / seconds,
        "trained_tokens_per_s": trained / seconds,
        "output_layer_tokens_per_s": (trained if output_layer_on_labels else tokens) / seconds,
        "final_loss": losses[-1],
        "peak_rss_gb": peak_rss_gb(),
    }


def child(arguments: argparse.Namespace) -> None:
    torch.manual_seed(0)
    root = Path(arguments.workspace)
    if arguments.contender.startswith("tuneforge"):
        compiled = arguments.contender == "tuneforge-compile"
        result = run_tuneforge(
            root,
            arguments.model,
            arguments.steps,
            arguments.lr,
            arguments.precision,
            1024,
            compiled,
            arguments.activation_checkpointing,
        )
    else:
        strategy = arguments.contender.removeprefix("trl-")
        result = run_trl(
            root,
            arguments.model,
            strategy,
            arguments.steps,
            arguments.lr,
            arguments.precision,
            1024,
            arguments.activation_checkpointing,
        )
    # This VM's speed drifts with its neighbours: the peak is measured again right after the steps, in the
    # same process, and each contender's MFU is against its own (after peak RSS was read).
    result["peak_flops"] = matmul_peak(torch.bfloat16 if arguments.precision == "bf16" else torch.float32)
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--bfd", action="store_true", help="also run TRL's padding-free bfd packing")
    parser.add_argument("--compile", action="store_true", help="also run tuneforge with train.compile=true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="every contender recomputes activations in backward"
    )
    parser.add_argument("--workspace", help="reuse a workspace directory (built when empty)")
    parser.add_argument("--child", dest="contender", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.contender:
        child(arguments)
        return

    models = arguments.models.split(",")
    contenders = arguments.contenders.split(",") + (["trl-bfd"] if arguments.bfd else [])
    contenders += ["tuneforge-compile"] if arguments.compile else []
    root = Path(arguments.workspace or tempfile.mkdtemp(prefix="compare_trl_"))
    root.mkdir(parents=True, exist_ok=True)
    if not all((root / m / "config.json").exists() for m in models):
        build_workspace(root, models, arguments.samples, 1024)
    dtype = torch.bfloat16 if arguments.precision == "bf16" else torch.float32
    peak = matmul_peak(dtype)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"measured {arguments.precision} matmul peak: {peak / 1e9:.1f} GFLOP/s (again after each contender below)")
    from transformers import AutoConfig

    for model in models:
        config = AutoConfig.from_pretrained(root / model)
        matmul, attention_width, output_layer = flops_shape(config, root / model)
        layers = config.num_hidden_layers
        print(f"\n== {model}: {matmul / 1e6:.1f}M matmul parameters active per token, {layers} layers")
        results: dict[str, dict] = {}
        for contender in contenders:
            command = [sys.executable, __file__, "--child", contender, "--model", model, "--workspace", str(root)]
            command += ["--steps", str(arguments.steps), "--lr", str(arguments.lr)]
            command += ["--precision", arguments.precision]
            command += ["--activation-checkpointing"] if arguments.activation_checkpointing else []
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                print(f"{contender}: failed (exit {done.returncode})\n{done.stderr[-2000:]}")
                continue
            result = json.loads(lines[-1].removeprefix("RESULT "))
            context = context_per_token(root, 1024, wrapped=contender == "trl-wrapped")
            per_token = 6 * matmul + 12 * config.num_hidden_layers * attention_width * context
            result["model_flops"] = per_token * result["tokens_per_s"]
            result["mfu"] = result["model_flops"] / result["peak_flops"]
            skipped = result["tokens_per_s"] - result["output_layer_tokens_per_s"]
            result["executed_flops"] = result["model_flops"] - 6 * output_layer * skipped
            result["wall_s"] = time.perf_counter() - started
            results[contender] = result
        print_table(results, max([peak] + [r["peak_flops"] for r in results.values()]))


def flops_shape(config, directory: Path) -> tuple[int, int, int]:
    """Matmul parameters a token passes through (routed experts: only the active ones), the attention width
    (the sum over heads of the query-key dimension, equal to the value width for these models) and the
    output layer's parameters."""
    from transformers import AutoModelForCausalLM

    from tuneforge.model.flops import active_matmul_parameters
    from tuneforge.model.moe import find_moe

    with torch.device("meta"):
        network = AutoModelForCausalLM.from_config(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0)
    head_dim = head_dim or config.hidden_size // heads
    return (
        active_matmul_parameters(network, find_moe(network)),
        heads * head_dim,
        network.get_output_embeddings().weight.numel(),
    )


def print_table(results: dict[str, dict], best_peak: float) -> None:
    """MFU against the contender's own peak, and against the best peak measured in this invocation."""
    header = (
        f"{'contender':<18}{'trained tok/s':>14}{'all tok/s':>11}{'padding':>9}{'peak RSS':>10}"
        f"{'final loss':>11}{'peak GF/s':>10}{'MFU':>7}{'MFU@best':>9}{'exec@best':>10}{'wall':>7}"
    )
    print(header)
    for name, r in results.items():
        print(
            f"{name:<18}{r['trained_tokens_per_s']:>14,.0f}{r['tokens_per_s']:>11,.0f}{r['padding']:>9.1%}"
            f"{r['peak_rss_gb']:>9.2f}G{r['final_loss']:>11.4f}{r['peak_flops'] / 1e9:>10.1f}{r['mfu']:>7.1%}"
            f"{r['model_flops'] / best_peak:>9.1%}{r['executed_flops'] / best_peak:>10.1%}{r['wall_s']:>6.0f}s"
        )
    for mine in ("tuneforge", "tuneforge-compile"):
        if mine not in results:
            continue
        ours = results[mine]
        for name, r in results.items():
            if name.startswith("tuneforge"):
                continue
            print(
                f"{mine} / {name}: trained tokens/s {ours['trained_tokens_per_s'] / r['trained_tokens_per_s']:.2f}x, "
                f"peak RSS {ours['peak_rss_gb'] / r['peak_rss_gb']:.2f}x"
            )


if __name__ == "__main__":
    main()
