"""tuneforge's DPO against Hugging Face TRL's DPOTrainer: same model, pairs, LoRA, batch, learning rate, epoch, CPU.

    .venv/bin/pip install trl            # benchmark-only dependency
    .venv/bin/python benchmarks/compare_trl_dpo.py [--pairs 256] [--workspace DIR]

One invocation builds a workspace (a randomly initialised Llama-architecture model with a 32,000-token
embedding, the byte tokenizer with a Qwen chat template, and synthetic preference pairs whose chosen answer is
written in lower case and rejected answer in upper case, lengths log-normal with a median of about 300 bytes),
then runs each contender in its own process, timed whole from the parent (imports, data preparation, the
reference and the epoch) and with its own peak RSS:

  trl        DPOTrainer with a PEFT LoRA config (its reference: the model with the adapters disabled), padded
             batches (TRL's default; its padding-free mode needs FlashAttention)
  tuneforge  train.objective: dpo with model.lora (the same reference), each pair's answers in one row

Both train one epoch of 8 pairs per step with LoRA r=16 on every linear layer, AdamW at a constant learning
rate, sigmoid loss with beta 0.1, fp32; both then score the same held-out pairs with their own evaluation and
report the reward accuracy (the share of pairs whose chosen answer's implicit reward is above the rejected's).
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from compare_trl import WORDS, save_tokenizer

VOCAB = 32_000
PAIRS_PER_STEP = 8
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
LR = 2e-4
BETA = 0.1
MAX_LENGTH = 1024


def text(rng: np.random.Generator, length: int) -> str:
    return " ".join(rng.choice(WORDS, size=length // 4 + 2))[:length]


def make_pairs(path: Path, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with path.open("w") as out:
        for size in np.clip(rng.lognormal(np.log(300), 0.5, size=count), 40, 600).astype(int):
            answer = text(rng, int(size * 0.7))
            row = {
                "prompt": [{"role": "user", "content": text(rng, max(8, int(size * 0.3)))}],
                "chosen": [{"role": "assistant", "content": answer.lower()}],
                "rejected": [{"role": "assistant", "content": answer.upper()}],
            }
            out.write(json.dumps(row) + "\n")


def build_workspace(root: Path, pairs: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    make_pairs(root / "train.jsonl", pairs, seed=0)
    make_pairs(root / "heldout.jsonl", 64, seed=1)
    tokenizer = save_tokenizer(root / "model")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")


def run_trl(root: Path) -> dict:
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32, attn_implementation="sdpa")
    args = DPOConfig(
        output_dir=str(root / "out-trl"),
        per_device_train_batch_size=PAIRS_PER_STEP,
        per_device_eval_batch_size=PAIRS_PER_STEP,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        num_train_epochs=1,
        beta=BETA,
        max_length=MAX_LENGTH,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules="all-linear")
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=load_dataset("json", data_files=str(root / "train.jsonl"), split="train"),
        eval_dataset=load_dataset("json", data_files=str(root / "heldout.jsonl"), split="train"),
        processing_class=tokenizer,
        peft_config=peft,
    )
    trainer.train()
    evaluation = trainer.evaluate()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"steps": len(losses), "final_loss": losses[-1], "accuracy": evaluation["eval_rewards/accuracies"]}


def run_tuneforge(root: Path) -> dict:
    from tuneforge.config.schema import Config
    from tuneforge.train.run import run_training

    work_dir = root / "out-tuneforge"
    cfg = Config.model_validate(
        {
            "model": {"path": str(root / "model"), "dtype": "float32", "lora": LORA},
            "data": {
                "train_files": [str(root / "train.jsonl")],
                "validation_files": [str(root / "heldout.jsonl")],
                "template": "qwen_chat",
                "max_length": MAX_LENGTH,
                "cache_dir": None,
            },
            "train": {
                "objective": "dpo",
                "lr": LR,
                "schedule": "constant",
                "warmup_steps": 0,
                "micro_batch_size": PAIRS_PER_STEP,
                "gradient_accumulation": 1,
                "epochs": 1,
                "max_grad_norm": 1.0,
                "precision": "fp32",
                "seed": 0,
            },
            "preference": {"beta": BETA},
            "checkpoint": {"every_steps": 0, "save_final": False},
            "eval": {"every_steps": 100000},
            "log": {"progress": "lines", "plot": False},
        }
    )
    run_training(cfg, work_dir)
    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").open()]
    return {
        "steps": len(records),
        "final_loss": records[-1]["loss"],
        "accuracy": records[-1]["val_rewards/accuracy"],
    }


def child(contender: str, root: Path) -> None:
    torch.manual_seed(0)
    result = run_trl(root) if contender == "trl" else run_tuneforge(root)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--contenders", default="trl,tuneforge")
    parser.add_argument("--workspace", help="reuse a workspace directory (built when empty)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    root = Path(arguments.workspace or tempfile.mkdtemp(prefix="dpo-bench-"))
    if arguments.child:
        child(arguments.child, root)
        return
    if not (root / "model").exists():
        root.mkdir(parents=True, exist_ok=True)
        build_workspace(root, arguments.pairs)
    results = {}
    for contender in arguments.contenders.split(","):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, __file__, "--child", contender, "--workspace", str(root)], capture_output=True, text=True
        )
        wall = time.perf_counter() - started
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(f"{contender} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        results[contender] = {**json.loads(lines[-1].removeprefix("RESULT ")), "wall_s": wall}
    print(f"{'contender':<10} {'wall s':>8} {'peak RSS GB':>12} {'steps':>6} {'final loss':>11} {'accuracy':>9}")
    for name, r in results.items():
        print(
            f"{name:<10} {r['wall_s']:>8.1f} {r['peak_rss_gb']:>12.2f} {r['steps']:>6} {r['final_loss']:>11.4f} "
            f"{r['accuracy']:>9.3f}"
        )
    if "trl" in results and "tuneforge" in results:
        trl, ours = results["trl"], results["tuneforge"]
        print(
            f"tuneforge vs trl: {trl['wall_s'] / ours['wall_s']:.2f}x faster (whole process), "
            f"{ours['peak_rss_gb'] / trl['peak_rss_gb']:.2f}x the peak memory"
        )


if __name__ == "__main__":
    main()
