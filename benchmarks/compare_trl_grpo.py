"""tuneforge's GRPO against Hugging Face TRL's GRPOTrainer on CPU: the same warm-started model, prompts, group
size, completion length, sampling, loss and steps, each contender a whole process of its own.

    # TRL is a benchmark-only dependency, kept out of the project venv (--no-deps leaves torch and transformers)
    .venv/bin/pip install --no-deps --target /tmp/trl_site trl==1.16.0
    PYTHONPATH=/tmp/trl_site .venv/bin/python benchmarks/compare_trl_grpo.py [--steps 100] [--workspace DIR]

The workspace is built once (or reused with `--workspace`): the GRPO demo's warm start (`configs/demo_grpo_sft.yaml`,
a fresh 3.3M-parameter Llama taught hex colour codes to RGB triples by SFT for 700 steps) exported merged with its
chat template, so both contenders start from the same weights and prompt format. Both then run GRPO on the demo's
prompts (`configs/data/hex_rgb_prompts_train.jsonl`): 16 prompts a step, 8 completions each of at most 20 tokens
sampled at temperature 0.7, an exact-match reward, the DAPO loss with clipping at 0.2 / 0.28, rewards scaled by
their group's standard deviation, no KL term, one update per rollout, AdamW at a constant 3e-5 without decay,
clipping at 1.0, fp32 (or `--precision bf16`: autocast in both), full fine-tuning, seed 0.

Printed: wall time of the whole process (imports to exit) and of the training loop, peak RSS (the child's own, read
with wait4), the mean reward every 10 steps side by side, and the held-out greedy exact match (200 colours never
trained on) of the warm start and of each contender's final model, scored by the same code (tuneforge's greedy
generation in the training template).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compare_trl_vlm import run_child

REPO = Path(__file__).resolve().parents[1]
TUNEFORGE = str(Path(sys.executable).parent / "tuneforge")
PROMPTS = REPO / "configs" / "data" / "hex_rgb_prompts_train.jsonl"
HELDOUT = REPO / "configs" / "data" / "hex_rgb_heldout.jsonl"
PROMPTS_PER_STEP = 16
GENERATIONS = 8
MAX_COMPLETION = 20
TEMPERATURE = 0.7
LR = 3e-5


def build_workspace(root: Path) -> None:
    if (root / "model" / "config.json").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    sft = root / "sft"
    started = time.time()
    subprocess.run(
        [TUNEFORGE, "train", "configs/demo_grpo_sft.yaml", "--work-dir", str(sft), "eval.exact_match=null"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [TUNEFORGE, "export", str(sft / "checkpoints" / "final"), "--out", str(root / "model"), "--merge"],
        check=True,
        capture_output=True,
    )
    with PROMPTS.open() as source, (root / "trl_prompts.jsonl").open("w") as out:
        for line in source:
            record = json.loads(line)
            out.write(
                json.dumps({"prompt": [{"role": "user", "content": record["prompt"]}], "answer": record["answer"]})
            )
            out.write("\n")
    print(f"workspace {root} built in {time.time() - started:.0f}s (SFT warm start and merged export)")


def run_trl(root: Path, steps: int, precision: str) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)

    def exact_match(completions, answer, **_):
        return [float(c[0]["content"].strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(root / "out-trl"),
        per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=GENERATIONS,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        num_iterations=1,
        mask_truncated_completions=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=precision == "bf16",
        seed=0,
        gradient_checkpointing=False,
        disable_dropout=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=load_dataset("json", data_files=str(root / "trl_prompts.jsonl"), split="train"),
        processing_class=tokenizer,
    )
    started = time.perf_counter()
    trainer.train()
    loop = time.perf_counter() - started
    final = root / "out-trl" / "final"
    trainer.save_model(str(final))
    shutil.copy(root / "model" / "tuneforge.json", final / "tuneforge.json")
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return {"loop_s": loop, "rewards": rewards, "final": str(final)}


def run_tuneforge(root: Path, steps: int, precision: str) -> dict:
    work = root / "out-tuneforge"
    if work.exists():
        shutil.rmtree(work)
    result = subprocess.run(
        [
            TUNEFORGE,
            "train",
            "configs/demo_grpo.yaml",
            "--work-dir",
            str(work),
            f"model.path={root / 'model'}",
            f"train.max_steps={steps}",
            f"train.precision={precision}",
            "eval.exact_match=null",
            "log.every_steps=1",
            "log.plot=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(result.stdout[-3000:] + result.stderr[-3000:])
    steps = [json.loads(line) for line in (work / "metrics.jsonl").open()]
    steps = [record for record in steps if "reward" in record]
    # elapsed_s counts from the training loop's start, as TRL's loop time is taken around trainer.train().
    loop = steps[-1]["elapsed_s"]
    return {
        "loop_s": loop,
        "rewards": [record["reward"] for record in steps],
        "final": str(work / "checkpoints" / "final"),
    }


def heldout_accuracy(model_dir: str) -> float:
    from tuneforge.data.conversation import Conversation, Turn
    from tuneforge.data.templates import recorded_template
    from tuneforge.generate import generate_replies
    from tuneforge.trained import load_trained

    trained = load_trained(Path(model_dir))
    template = recorded_template(trained.meta["template"], Path(model_dir))
    records = [json.loads(line) for line in HELDOUT.open()]
    prompts = [Conversation((Turn(r["messages"][0]["content"], None),), "heldout") for r in records]
    replies = generate_replies(trained.model, trained.tokenizer, template, prompts, None, 24, batch_size=200)
    right = sum(reply.strip() == r["messages"][1]["content"] for reply, r in zip(replies, records, strict=True))
    return right / len(records)


def child(contender: str, root: Path, steps: int, precision: str, out: Path) -> None:
    runner = run_trl if contender == "trl" else run_tuneforge
    result = runner(root, steps, precision)
    out.write_text(json.dumps(result))


def run_contender(contender: str, root: Path, steps: int, precision: str) -> dict:
    """One contender in a process of its own, with its wall time, CPU time and peak RSS (wait4: its own)."""
    command = [sys.executable, __file__, "--child", contender, "--workspace", str(root), "--steps", str(steps)]
    command += ["--precision", precision]
    code, wall, cpu, peak, log = run_child(command, root / f"log-{contender}.txt")
    if code:
        raise SystemExit(f"{contender} failed:\n{log[-3000:]}")
    result = json.loads((root / f"result-{contender}.json").read_text())
    return {**result, "wall_s": wall, "cpu_s": cpu, "peak_rss_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workspace", type=Path)
    parser.add_argument("--child", choices=["trl", "tuneforge"])
    parser.add_argument("--contenders", default="trl,tuneforge")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast in both")
    arguments = parser.parse_args()
    if arguments.child:
        out = arguments.workspace / f"result-{arguments.child}.json"
        child(arguments.child, arguments.workspace, arguments.steps, arguments.precision, out)
        return
    root = arguments.workspace or Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    build_workspace(root)
    shape = f"{arguments.steps} steps of {PROMPTS_PER_STEP} prompts x {GENERATIONS}, {arguments.precision}"
    print(f"machine: {os.cpu_count()} CPUs; {shape}")
    runs = {}
    for contender in arguments.contenders.split(","):
        runs[contender] = run_contender(contender, root, arguments.steps, arguments.precision)
        print(f"  {contender}: {runs[contender]['wall_s']:.0f}s")
    before = heldout_accuracy(str(root / "model"))
    print(f"\nheld-out exact match: warm start {before:.3f}", end="")
    for name, run in runs.items():
        run["heldout"] = heldout_accuracy(run["final"])
        print(f", {name} {run['heldout']:.3f}", end="")
    print()
    header = ["wall s", "loop s", "CPU s", "s/step", "peak RSS", "reward 1-10", "last 10"]
    print(f"\n{'contender':<10} " + " ".join(f"{h:>11}" for h in header))
    for name, run in runs.items():
        rewards = run["rewards"]
        cells = [
            f"{run['wall_s']:.1f}",
            f"{run['loop_s']:.1f}",
            f"{run['cpu_s']:.0f}",
            f"{run['loop_s'] / max(1, len(rewards)):.2f}",
            f"{run['peak_rss_gib']:.2f}Gi",
            f"{sum(rewards[:10]) / 10:.3f}",
            f"{sum(rewards[-10:]) / 10:.3f}",
        ]
        print(f"{name:<10} " + " ".join(f"{cell:>11}" for cell in cells))
    print("\nmean reward per 10 steps:")
    print("steps    " + "  ".join(f"{name:>9}" for name in runs))
    for start in range(0, arguments.steps, 10):
        cells = [
            sum(run["rewards"][start : start + 10]) / max(1, len(run["rewards"][start : start + 10]))
            for run in runs.values()
        ]
        print(f"{start + 1:>3}-{start + 10:<4} " + "  ".join(f"{cell:>9.3f}" for cell in cells))
    if {"trl", "tuneforge"} <= set(runs):
        trl, ours = runs["trl"], runs["tuneforge"]
        print(
            f"\ntuneforge / trl: loop {trl['loop_s'] / ours['loop_s']:.2f}x faster, whole process "
            f"{ours['wall_s'] / trl['wall_s']:.2f}x the wall time"
        )


if __name__ == "__main__":
    main()
