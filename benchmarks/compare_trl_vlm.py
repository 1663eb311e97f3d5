"""Vision-language fine-tuning, tuneforge against Hugging Face TRL's SFTTrainer: the same fresh LLaVA, image corpus,
batch, learning rate, precision, one epoch, each contender a whole process of its own.

    # TRL is a benchmark-only dependency, kept out of the project venv (its dependencies are already there:
    # accelerate, datasets, pandas, psutil, pyarrow; --no-deps leaves torch and transformers alone)
    .venv/bin/pip install --no-deps --target /tmp/trl_site trl==1.16.0
    PYTHONPATH=/tmp/trl_site .venv/bin/python benchmarks/compare_trl_vlm.py [--preset cpu] [--precision fp32]

One invocation builds a workspace once (or reuses `--workspace`): a fresh LLaVA (`fresh_vision.fresh_vlm`: a CLIP
tower, a projector and a Llama; the byte tokenizer's vocabulary padded to 32,000 rows so the output layer costs what
a real one does) saved with its processor, and a synthetic corpus of PIL-drawn pictures of shapes with questions
and replies whose lengths follow a log-normal, plus 15% text-only chats. It is written twice: tuneforge's form
(OpenAI `image` content parts) and TRL's documented VLM form (a `messages` column of strings and an `images`
column; TRL puts each sample's images before its first user text, which renders the same tokens).

Contenders, one process each and one at a time (peak RSS is the process' own, read with wait4):

  trl                 SFTTrainer with the model's processor as processing_class, batches of --batch samples
                      padded to the longest (TRL refuses packing and padding-free for vision datasets),
                      assistant_only_loss through a copy of the processor's template with {% generation %}
                      markers; gradient_checkpointing=False, as tuneforge's default
  trl-gc              (not in the default list) the same with TRL's default gradient_checkpointing=True
  tuneforge-unpacked  data.packing=false, micro-batches of --batch samples (grouped by length, its default)
  tuneforge-packed    data.packing=true: rows of the preset's max_length (512 on cpu), as many per step as carry
                      the real tokens of --batch samples on average (--rows: so both make about as many steps)

Every contender trains all three parts (tower, projector, language model: TRL's default, `model.vision` tower:
full in tuneforge), with a constant learning rate, AdamW without weight decay, clipping at 1.0, a loss on the
assistant reply only, for one epoch (or --max-steps). Tokens are real tokens (image tokens included, padding not);
tokens/s is over the training loop (first step to last, TRL's on-the-fly image processing included, tuneforge's
data preparation before the loop not), `steady` leaves out step 1; wall is the whole process, imports to exit.
On a shared machine neighbours stretch wall time: tok/CPUs (tokens per CPU second of the loop, all threads) and
`p90 step` (the rate the fastest tenth of steps exceed) move less.

`--preset gpu` (a ~126M-parameter LLaVA, 224 px images, 256 image tokens, bf16, rows of 1024) is the step
`benchmarks/gpu_session.sh 4` runs on a lent GPU for a few steps: tokens/s and peak GPU memory (max allocated)
of tuneforge packed against unpacked, and TRL's where it is installed. `--preset smoke` is a seconds-long check.
"""

from __future__ import annotations

import argparse
import importlib.util
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
TEXT_ONLY = 0.15
CONTENDERS = ("trl", "tuneforge-unpacked", "tuneforge-packed")
PRESETS = {
    # text: hidden 384, 6 layers (10.6M in its blocks) + 2 x 12.3M embedding/output; tower: CLIP 256 wide,
    # 4 layers, 112 px in 14 px patches = 64 image tokens
    "cpu": {
        "text": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6},
        "vision": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4},
        "image_size": 112,
        "max_length": 512,
        "samples": 320,
        "reply_median": 120,
        "precision": "fp32",
    },
    # text: hidden 768, 8 layers; tower: CLIP 512 wide, 6 layers, 224 px = 256 image tokens (126M parameters)
    "gpu": {
        "text": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12},
        "vision": {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 8},
        "image_size": 224,
        "max_length": 1024,
        "samples": 1200,
        "reply_median": 240,
        "precision": "bf16",
    },
    "smoke": {
        "text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
        "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
        "image_size": 28,
        "max_length": 160,
        "samples": 24,
        "reply_median": 30,
        "precision": "fp32",
        "vocab": None,  # the byte tokenizer's own
    },
}
WORDS = [
    "the",
    "a",
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "square",
    "circle",
    "triangle",
    "left",
    "right",
    "top",
    "bottom",
    "small",
    "large",
    "shape",
    "colour",
    "picture",
    "corner",
    "middle",
    "next",
    "to",
    "above",
    "below",
    "two",
    "three",
    "one",
    "edge",
    "line",
    "bright",
    "dark",
]
QUESTIONS = [
    "What is in the picture?",
    "Describe the shapes.",
    "Which colours do you see?",
    "Where is the largest shape?",
    "How many shapes are there, and what are they?",
]
SHAPES = ("square", "circle", "triangle")


# ---------------------------------------------------------------- workspace


def words(rng: np.random.Generator, length: int) -> str:
    return " ".join(rng.choice(WORDS, size=length // 4 + 2))[:length]


def draw(rng: np.random.Generator, path: Path) -> str:
    """A picture of 1-4 shapes; returns a short true description of it."""
    from PIL import Image, ImageDraw

    width, height = (int(v) for v in rng.integers(48, 200, size=2))
    background = tuple(int(v) for v in rng.integers(0, 256, size=3))
    picture = Image.new("RGB", (width, height), background)
    pen = ImageDraw.Draw(picture)
    said = []
    for _ in range(int(rng.integers(1, 5))):
        x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
        x1, y1 = int(rng.integers(x0 + 4, width)), int(rng.integers(y0 + 4, height))
        colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
        shape = SHAPES[int(rng.integers(0, 3))]
        if shape == "square":
            pen.rectangle((x0, y0, x1, y1), fill=colour)
        elif shape == "circle":
            pen.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            pen.polygon([(x0, y1), (x1, y1), ((x0 + x1) // 2, y0)], fill=colour)
        said.append(f"a {shape} at {x0},{y0}")
    picture.save(path)
    return ", ".join(said) + "."


def make_corpus(root: Path, samples: int, max_length: int, image_tokens: int, reply_median: int, seed: int = 0):
    """`messages.jsonl` (tuneforge) and `trl.jsonl` (TRL), the same chats; the images under `images/`."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    # The template adds about 40 tokens; the question up to 80: every sample fits max_length.
    cap = max_length - image_tokens - 40 - 90
    replies = np.clip(rng.lognormal(mean=np.log(reply_median), sigma=0.7, size=samples), 8, cap).astype(int)
    with (root / "messages.jsonl").open("w") as ours, (root / "trl.jsonl").open("w") as theirs:
        for index, size in enumerate(replies):
            question = QUESTIONS[index % len(QUESTIONS)] + " " + words(rng, int(rng.integers(0, 40)))
            if rng.random() < TEXT_ONLY:
                reply = words(rng, int(size))
                user, images = question, []
            else:
                name = f"images/{index}.png"
                described = draw(rng, root / name)
                reply = (described + " " + words(rng, max(0, int(size) - len(described))))[: max(int(size), 8)]
                user = [{"type": "image", "image": name}, {"type": "text", "text": question}]
                images = [str(root / name)]
            assistant = {"role": "assistant", "content": reply}
            ours.write(json.dumps({"messages": [{"role": "user", "content": user}, assistant]}) + "\n")
            theirs.write(
                json.dumps({"messages": [{"role": "user", "content": question}, assistant], "images": images}) + "\n"
            )


def build_model(root: Path, preset: dict) -> None:
    from tuneforge.data.byte_tokenizer import build_byte_tokenizer
    from tuneforge.model.fresh_vision import fresh_vlm

    text, vision, side = preset["text"], preset["vision"], preset["image_size"]
    size = {
        "text_config": {
            "model_type": "llama",
            **text,
            "num_key_value_heads": text["num_attention_heads"],
            "max_position_embeddings": 2 * preset["max_length"],
            "tie_word_embeddings": False,
        },
        "vision_config": {"model_type": "clip_vision_model", **vision, "image_size": side, "patch_size": 14},
    }
    model, processor = fresh_vlm("llava", size, build_byte_tokenizer(), seed=0)
    vocab = preset.get("vocab", VOCAB)
    if vocab:  # the output layer of a real vocabulary; the byte tokenizer uses the first ids
        model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(root / "model")
    processor.save_pretrained(root / "model")


def image_tokens_of(preset: dict) -> int:
    return (preset["image_size"] // 14) ** 2  # CLIP's CLS dropped by LLaVA's `default` feature strategy


def build_workspace(root: Path, preset: dict, samples: int) -> None:
    make_corpus(root, samples, preset["max_length"], image_tokens_of(preset), preset["reply_median"])
    build_model(root, preset)


def sample_lengths(root: Path) -> list[int]:
    """Tokens of each chat as the processor renders and expands it (its template, image tokens included)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(root / "model")
    lengths = []
    for line in (root / "messages.jsonl").open():
        messages = json.loads(line)["messages"]
        text = processor.apply_chat_template(messages, tokenize=False)
        content = messages[0]["content"]
        images = [] if isinstance(content, str) else [Image.open(root / p["image"]) for p in content if "image" in p]
        batch = processor(text=[text], images=images or None, add_special_tokens=False)
        lengths.append(len(batch["input_ids"][0]))
    return lengths


# ---------------------------------------------------------------- contenders


def trl_template() -> str:
    """The processor's template (`fresh_vision.vision_chat_template` for LLaVA) for TRL's lists of content parts,
    with the assistant's reply and its end-of-turn token inside {% generation %} markers (what
    `assistant_only_loss` masks by); it renders the same text. tuneforge also trains the newline after the
    end-of-turn token (its template's turn ends there): one trained token per reply more, the same compute."""
    body = (
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' -%}{{ '<image>\\n' }}{%- else -%}{{ part['text'] }}{%- endif -%}"
        "{%- endfor -%}"
    )
    return (
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' ~ message['role'] ~ '\\n' }}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- generation -%}" + body + "{{ eos_token }}{%- endgeneration -%}{{ '\\n' }}"
        "{%- else -%}" + body + "{{ eos_token ~ '\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


class Steps:
    """Per optimizer step: (real tokens, trained tokens, positions computed) and the time at its end."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int]] = []
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.cpu_started = 0.0
        self.loop_cpu_s = float("nan")


def run_trl(root: Path, arguments: argparse.Namespace, preset: dict, gradient_checkpointing: bool) -> dict:
    from datasets import Image, List, load_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    processor = AutoProcessor.from_pretrained(root / "model")
    rendered = processor.apply_chat_template(
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "r"}]},
        ],
        tokenize=False,
    )
    processor.chat_template = trl_template()
    assert (
        processor.apply_chat_template(
            [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "r"}]},
            ],
            tokenize=False,
        )
        == rendered
    ), "TRL's template must render what the processor's does"
    network = AutoModelForImageTextToText.from_pretrained(
        root / "model", dtype=torch.float32, attn_implementation="sdpa"
    )
    dataset = load_dataset("json", data_files=str(root / "trl.jsonl"), split="train")
    dataset = dataset.cast_column("images", List(Image()))
    args = SFTConfig(
        output_dir=str(root / "out-trl"),
        max_length=preset["max_length"],
        per_device_train_batch_size=arguments.batch,
        gradient_accumulation_steps=1,
        learning_rate=arguments.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        num_train_epochs=1,
        max_steps=arguments.max_steps or -1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not cuda,
        bf16=arguments.precision == "bf16",
        gradient_checkpointing=gradient_checkpointing,
        assistant_only_loss=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    steps = Steps()

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            steps.cpu_started = time.process_time()

        def on_train_end(self, args, state, control, **kwargs):
            steps.loop_cpu_s = time.process_time() - steps.cpu_started

        def on_step_begin(self, args, state, control, **kwargs):
            if not steps.ends:
                steps.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            steps.ends.append(time.perf_counter())

    trainer = SFTTrainer(model=network, args=args, train_dataset=dataset, processing_class=processor)
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        labels = batch["labels"]
        steps.batches.append(
            (int(batch["attention_mask"].sum()), int((labels[:, 1:] != -100).sum()), int(labels.numel()))
        )
        return batch

    trainer.data_collator = counting_collator
    trainer.add_callback(Timer())
    trainer.train()
    steps.losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    durations = list(np.diff(steps.ends))
    return summarize(steps.batches[: len(durations)], durations, steps.losses, steps.loop_cpu_s)


def run_tuneforge(root: Path, arguments: argparse.Namespace, preset: dict, packed: bool, rows: int) -> dict:
    from tuneforge.config.schema import Config
    from tuneforge.train.run import run_training

    work_dir = root / f"out-tuneforge-{'packed' if packed else 'unpacked'}"
    shutil.rmtree(work_dir, ignore_errors=True)  # a fresh run each time (a work dir with a run is refused)
    train = {
        "lr": arguments.lr,
        "schedule": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "micro_batch_size": rows if packed else arguments.batch,
        "gradient_accumulation": 1,
        "epochs": 1,
        "max_grad_norm": 1.0,
        "precision": arguments.precision,
        "seed": 0,
    }
    if arguments.max_steps:
        train["max_steps"] = arguments.max_steps
    cfg = Config.model_validate(
        {
            "model": {
                "path": str(root / "model"),
                "dtype": "float32",
                "vision": {"tower": "full", "projector": "full", "language": "train"},
            },
            "data": {
                "train_files": [str(root / "messages.jsonl")],
                "max_length": preset["max_length"],
                "packing": packed,
                "cache_dir": None,
            },
            "train": train,
            "checkpoint": {"every_steps": 0, "save_final": False},
            "log": {"progress": "lines", "plot": False},
        }
    )
    from tuneforge.train import loop

    steps, run = Steps(), loop.Trainer.run

    def timed_run(self, *args, **kwargs):  # the CPU time of the training loop, as TRL's on_train_begin/end
        started = time.process_time()
        try:
            return run(self, *args, **kwargs)
        finally:
            steps.loop_cpu_s = time.process_time() - started

    loop.Trainer.run = timed_run
    run_training(cfg, work_dir)
    records = [json.loads(line) for line in (work_dir / "metrics.jsonl").open()]
    batches = [(r["tokens"], r["trained_tokens"], round(r["tokens"] / (1 - r["padding"]))) for r in records]
    ends = [r["elapsed_s"] for r in records]
    durations = list(np.diff([0.0, *ends]))
    return summarize(batches, durations, [r["loss"] for r in records], steps.loop_cpu_s)


def summarize(
    batches: list[tuple[int, int, int]], durations: list[float], losses: list[float], loop_cpu_s: float
) -> dict:
    """`loop_cpu_s`: the process' CPU time (all threads) over the training loop: on a shared machine, where
    neighbours stretch wall time, tokens per CPU second moves less."""
    tokens = sum(b[0] for b in batches)
    steady = sum(b[0] for b in batches[1:])
    return {
        "steps": len(durations),
        "tokens": tokens,
        "trained_tokens": sum(b[1] for b in batches),
        "padding": 1 - tokens / sum(b[2] for b in batches),
        "train_s": float(sum(durations)),
        "first_step_s": float(durations[0]),
        "tokens_per_s": tokens / sum(durations),
        "trained_tokens_per_s": sum(b[1] for b in batches) / sum(durations),
        "tokens_per_cpu_s": tokens / loop_cpu_s,
        # The rate its fastest tenth of steps exceed: on a shared machine, near what it does undisturbed.
        "p90_step_tokens_per_s": float(np.percentile([b[0] / d for b, d in zip(batches, durations, strict=True)], 90)),
        "step_tokens": [b[0] for b in batches],
        "step_s": [round(float(d), 4) for d in durations],
        "steady_tokens_per_s": steady / sum(durations[1:]) if len(durations) > 1 else float("nan"),
        "final_loss": losses[-1],
        "mean_loss_last": float(np.mean(losses[-5:])),
        "self_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }


def child(arguments: argparse.Namespace) -> None:
    torch.manual_seed(0)
    root = Path(arguments.workspace)
    preset = PRESETS[arguments.preset]
    name = arguments.contender
    if name in ("trl", "trl-gc"):
        result = run_trl(root, arguments, preset, gradient_checkpointing=name == "trl-gc")
    else:
        result = run_tuneforge(root, arguments, preset, packed=name == "tuneforge-packed", rows=arguments.rows)
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- report


def run_child(command: list[str], log: Path) -> tuple[int, float, float, float, str]:
    """(exit status, wall seconds, CPU seconds, peak RSS in GiB of the child and what it waited for, its output)."""
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    return process.returncode, time.perf_counter() - started, cpu, usage.ru_maxrss / 1024**2, log.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated; also trl-gc")
    parser.add_argument("--batch", type=int, default=8, help="samples per step (TRL, tuneforge unpacked)")
    parser.add_argument("--rows", type=int, help="packed rows per step (default: the real tokens of --batch samples)")
    parser.add_argument("--samples", type=int, help="chats in the corpus (default: the preset's)")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps (default: one epoch)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: the preset's")
    parser.add_argument("--repeat", type=int, default=1, help="run the contenders this many times, in turn")
    parser.add_argument("--workspace", help="reuse a workspace directory (built when empty)")
    parser.add_argument("--child", dest="contender", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    preset = PRESETS[arguments.preset]
    arguments.precision = arguments.precision or preset["precision"]
    if arguments.contender:
        child(arguments)
        return

    root = Path(arguments.workspace or tempfile.mkdtemp(prefix="compare_trl_vlm_"))
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "model" / "config.json").exists():
        started = time.perf_counter()
        build_workspace(root, preset, arguments.samples or preset["samples"])
        print(f"workspace {root} built in {time.perf_counter() - started:.0f}s")
    lengths = np.array(sample_lengths(root))
    image_samples = sum(1 for line in (root / "trl.jsonl").open() if json.loads(line)["images"])
    rows = arguments.rows or max(1, round(arguments.batch * lengths.mean() / preset["max_length"]))
    contenders = arguments.contenders.split(",")
    missing = [name for name in ("trl", "datasets") if importlib.util.find_spec(name) is None]
    if any(c.startswith("trl") for c in contenders) and missing:
        print(f"{' and '.join(missing)} not installed here (see the docstring): tuneforge only")
        contenders = [c for c in contenders if not c.startswith("trl")]

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root / "model")
    with torch.device("meta"):
        from transformers import AutoModelForImageTextToText

        parameters = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{os.cpu_count()} CPUs"
    print(f"machine: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"model: LLaVA, {parameters / 1e6:.1f}M parameters (text hidden {config.text_config.hidden_size} x "
        f"{config.text_config.num_hidden_layers} layers, vocabulary {config.text_config.vocab_size}; CLIP "
        f"{config.vision_config.hidden_size} x {config.vision_config.num_hidden_layers} layers, "
        f"{config.vision_config.image_size} px = {image_tokens_of(preset)} image tokens), {arguments.precision}"
    )
    print(
        f"corpus: {len(lengths)} chats ({image_samples} with an image), {int(lengths.sum()):,} tokens, median "
        f"{int(np.median(lengths))}, max {int(lengths.max())}; {arguments.batch} samples per step, or packed rows "
        f"of {preset['max_length']}: {rows} per step; "
        + (f"{arguments.max_steps} steps" if arguments.max_steps else "one epoch")
    )
    runs: list[tuple[str, dict]] = []
    for round_ in range(arguments.repeat):
        for contender in contenders:
            command = [sys.executable, __file__, "--child", contender, "--workspace", str(root)]
            command += ["--preset", arguments.preset, "--batch", str(arguments.batch), "--rows", str(rows)]
            command += ["--lr", str(arguments.lr), "--precision", arguments.precision]
            command += ["--max-steps", str(arguments.max_steps)] if arguments.max_steps else []
            code, wall, cpu, rss, out = run_child(command, root / f"log-{contender}-{round_}.txt")
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if code != 0 or not lines:
                print(f"{contender}: failed (exit {code}), log {root}/log-{contender}-{round_}.txt\n{out[-3000:]}")
                continue
            result = json.loads(lines[-1].removeprefix("RESULT "))
            result.update(wall_s=wall, cpu_s=cpu, peak_rss_gib=rss)
            runs.append((contender, result))
            print(f"  [{round_ + 1}] {contender}: {wall:.0f}s", flush=True)
        print_table(runs[-len(contenders) :] if arguments.repeat > 1 else runs)


def print_table(runs: list[tuple[str, dict]]) -> None:
    """Per contender: the epoch's steps and tokens, the training loop's seconds and tokens per second (all steps,
    and steady: from step 2), tokens per CPU second of the loop, the whole process' wall and CPU seconds, peak
    RSS (and peak GPU memory), the last step's loss; then each tuneforge contender against TRL."""
    gpu = any(r["peak_gpu_gib"] is not None for _, r in runs)
    print(
        f"{'contender':<19}{'steps':>6}{'tokens':>8}{'trained':>8}{'padding':>8}{'loop s':>8}{'1st s':>6}"
        f"{'tok/s':>7}"
        f"{'steady':>7}{'tok/CPUs':>9}{'p90 step':>9}{'wall s':>8}{'CPU s':>7}{'peak RSS':>10}"
        + (f"{'peak GPU':>10}" if gpu else "")
        + f"{'loss':>7}"
    )
    for name, r in runs:
        print(
            f"{name:<19}{r['steps']:>6}{r['tokens']:>8,}{r['trained_tokens']:>8,}{r['padding']:>8.1%}"
            f"{r['train_s']:>8.1f}{r['first_step_s']:>6.1f}{r['tokens_per_s']:>7,.0f}{r['steady_tokens_per_s']:>7,.0f}"
            f"{r['tokens_per_cpu_s']:>9,.0f}{r['p90_step_tokens_per_s']:>9,.0f}{r['wall_s']:>8.1f}{r['cpu_s']:>7.0f}{r['peak_rss_gib']:>8.2f}Gi"
            + (f"{r['peak_gpu_gib']:>8.2f}Gi" if gpu else "")
            + f"{r['final_loss']:>7.3f}"
        )
    base = dict(runs)
    pairs = [(name, reference) for reference in ("trl", "trl-gc") if reference in base for name in base]
    pairs = [(name, reference) for name, reference in pairs if name.startswith("tuneforge")]
    if "tuneforge-packed" in base and "tuneforge-unpacked" in base:
        pairs.append(("tuneforge-packed", "tuneforge-unpacked"))
    for name, reference in pairs:
        ours, theirs = base[name], base[reference]
        memory = f"peak RSS {ours['peak_rss_gib'] / theirs['peak_rss_gib']:.2f}x"
        if gpu:
            memory += f", peak GPU {ours['peak_gpu_gib'] / theirs['peak_gpu_gib']:.2f}x"
        print(
            f"{name} / {reference}: tokens/s {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x "
            f"(steady {ours['steady_tokens_per_s'] / theirs['steady_tokens_per_s']:.2f}x, per CPU second "
            f"{ours['tokens_per_cpu_s'] / theirs['tokens_per_cpu_s']:.2f}x, p90 step "
            f"{ours['p90_step_tokens_per_s'] / theirs['p90_step_tokens_per_s']:.2f}x), whole process in "
            f"{ours['wall_s'] / theirs['wall_s']:.2f}x the wall time, {memory}"
        )


if __name__ == "__main__":
    main()
