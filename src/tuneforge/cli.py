"""The `tuneforge` command line."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
from pathlib import Path

from tuneforge.errors import UserError
from tuneforge.recipes.command import add_parser as add_recipes_parser
from tuneforge.recipes.command import run as run_recipes

TRAIN_EXAMPLES = """examples:
  tuneforge train configs/demo.yaml
  tuneforge train configs/demo.yaml train.lr=1e-4 data.max_length=512
  tuneforge train my.yaml train.max_steps=10 --work-dir /tmp/try
  tuneforge train my.yaml --resume auto                             (after a crash: newest step checkpoint)
  tuneforge train my.yaml --nproc-per-node 8                       (8 processes on this node)
  tuneforge train my.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1
  torchrun --nproc-per-node 8 -m tuneforge train my.yaml           (also works, as does srun)

Overrides are dotted keys with YAML values; `tuneforge config-docs` lists every key.
Outputs go to the work dir (default work_dirs/<config name>): config.yaml, metrics.jsonl, plot.png,
samples.jsonl, eval.json and checkpoints/step-N/ and checkpoints/final/ in Hugging Face format."""

CHAT_EXAMPLES = """examples:
  tuneforge chat work_dirs/demo/checkpoints/final --prompt "#ff8800"
  tuneforge chat work_dirs/demo/checkpoints/step-500          (interactive)
  tuneforge chat work_dirs/qlora/checkpoints/final            (an adapter: its base is loaded as in training)
  tuneforge chat exported/merged                              (a model written by tuneforge export --merge)
  tuneforge chat work_dirs/demo_vlm/checkpoints/final --image shape.png --prompt "Which colour?"   (a VLM)"""

EXPORT_EXAMPLES = """examples:
  tuneforge export work_dirs/lora/checkpoints/final --out exported/adapter
  tuneforge export work_dirs/lora/checkpoints/final --out exported/merged --merge --dtype bf16
  tuneforge export work_dirs/lora/checkpoints/final --out exported/adapter --base /models/base
  tuneforge export work_dirs/lora/checkpoints/final --out exported/gguf --format gguf --outtype q8_0
  tuneforge export work_dirs/lora/checkpoints/final --out exported/vllm --for vllm

Without --merge: a PEFT adapter directory (PeftModel.from_pretrained loads it onto its base).
With --merge: a full model in safetensors that AutoModelForCausalLM.from_pretrained loads, adapters folded
into the base weights (for QLoRA, into the dequantized 4-bit weights the adapter was trained against).
Both include the tokenizer, the training chat template as Jinja and the generation config."""


EVAL_EXAMPLES = """examples:
  tuneforge eval work_dirs/demo --tasks my_tasks/hex_rgb.yaml                   (a local task file: offline)
  tuneforge eval work_dirs/lora/checkpoints/final --tasks hellaswag,arc_easy --limit 200
  tuneforge eval exported/merged --tasks mmlu --out results/merged.json --base /models/base

Scores the checkpoint (a full model, or an adapter applied in process) with lm-evaluation-harness
(pip install 'tuneforge[eval]'), prompts in the chat template the run trained with, and its base beside
it: an adapter's base with the adapters disabled (after checking they change the logits), else --base or
the model the run started from. Results: --out (default WORK_DIR/eval/lm_eval.json), in the harness's
layout, the base's under `base`."""

GPU_CHOICES = ["h100", "h200", "a100-80gb", "a100-40gb", "l40s", "a10g", "l4"]
"""The keys of `estimate.hardware.ACCELERATORS`, written out so that `--help` does not import torch."""


TRUST_HELP = (
    "run the Python files of a model whose architecture transformers lacks (never enabled by a checkpoint itself)"
)


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text}")
    return value


def _int_from(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum], refused with the range otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tuneforge",
        description="Fine-tune Hugging Face causal language models (dense and MoE; full, LoRA, QLoRA).",
        epilog="examples:\n  tuneforge train configs/demo.yaml\n  tuneforge chat work_dirs/demo/checkpoints/final\n"
        "  tuneforge export work_dirs/demo/checkpoints/final --out exported --merge",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="train from a YAML config",
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", type=Path, help="YAML config file")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.lr=1e-4")
    train.add_argument("--work-dir", type=Path, help="output directory (default: work_dirs/<config name>)")
    train.add_argument("--deepspeed", metavar="PRESET", help="with an xtuner .py config: its DeepSpeed preset")
    train.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue from a step checkpoint: `auto` takes the newest complete one in the work dir",
    )
    train.add_argument(
        "--allow-reward-code",
        action="store_true",
        help="let rl.rewards of kind python import and run the functions they name (a config alone never runs code)",
    )
    train.add_argument(
        "--archive-previous",
        action="store_true",
        help="the work dir holds another run's outputs: move them to WORK_DIR/previous-runs/ and start afresh",
    )
    launch = train.add_argument_group("launching several processes (PyTorch's elastic launcher)")
    launch.add_argument(
        "--nproc-per-node", type=_int_from(1), default=1, help="worker processes on this node (default 1)"
    )
    launch.add_argument("--nnodes", type=_int_from(1), default=1, help="number of nodes (default 1)")
    launch.add_argument("--node-rank", type=_int_from(0), default=0, help="this node's index, 0..nnodes-1 (default 0)")
    launch.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    launch.add_argument("--master-port", type=_int_from(1, 65535), default=29500, help="port on node 0 (default 29500)")

    chat = commands.add_parser(
        "chat",
        help="chat with a checkpoint",
        epilog=CHAT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument("checkpoint", type=Path, help="a checkpoints/step-N or checkpoints/final directory")
    chat.add_argument("--prompt", help="answer this one prompt and exit (default: interactive)")
    chat.add_argument("--system", help="system prompt (default: the one used in training)")
    chat.add_argument("--template", help="chat template name (default: the one used in training)")
    chat.add_argument("--max-new-tokens", type=_int_from(1), default=256, help="reply length limit (default 256)")
    chat.add_argument("--base", type=Path, help="base model of an adapter checkpoint (default: as recorded)")
    chat.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    chat.add_argument(
        "--image",
        type=Path,
        action="append",
        help="an image for the prompt (a vision-language model; repeat for several; --prompt defaults to asking "
        "for a description)",
    )

    export = commands.add_parser(
        "export",
        help="write a checkpoint as a PEFT adapter or a merged full model",
        epilog=EXPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("checkpoint", type=Path, help="a checkpoints/step-N or checkpoints/final directory")
    export.add_argument("--out", type=Path, required=True, help="new output directory")
    export.add_argument("--merge", action="store_true", help="fold adapters into the base: one full model")
    export.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], help="weight dtype (default: the base model's dtype)"
    )
    export.add_argument("--base", type=Path, help="base model of an adapter checkpoint (default: as recorded)")
    export.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)
    export.add_argument(
        "--format",
        choices=["hf", "gguf"],
        default="hf",
        help="hf: safetensors for transformers, vLLM, SGLang (default); gguf: one file for llama.cpp and Ollama, "
        "adapters merged, with a Modelfile",
    )
    export.add_argument(
        "--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16", help="GGUF weight type (default f16)"
    )
    export.add_argument(
        "--for",
        dest="server",
        choices=["vllm", "sglang"],
        help="an adapter in the layout that server's model class reads (experts one pair per expert where it "
        "reads them so), with the training chat template as chat_template.jinja",
    )

    evaluate = commands.add_parser(
        "eval",
        help="score a checkpoint and its base with lm-evaluation-harness tasks",
        epilog=EVAL_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    evaluate.add_argument("target", type=Path, help="a checkpoint, a run's work dir (its final checkpoint) or a model")
    evaluate.add_argument(
        "--tasks", required=True, help="harness task names and local task YAML files, comma-separated"
    )
    evaluate.add_argument("--limit", type=_int_from(1), help="score the first N examples of each task")
    evaluate.add_argument("--out", type=Path, help="JSON file to write (default: WORK_DIR/eval/lm_eval.json)")
    evaluate.add_argument(
        "--base", type=Path, help="the base model: an adapter's (default: as recorded), or the one to compare with"
    )
    evaluate.add_argument("--no-base", action="store_true", help="score the target alone")
    evaluate.add_argument("--batch-size", type=_int_from(1), default=16, help="the harness's batch size (default 16)")
    evaluate.add_argument("--device", help="e.g. cpu, cuda:0 (default: cuda when there is one, else cpu)")
    evaluate.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default="fp32", help="compute dtype of the weights (default fp32)"
    )
    evaluate.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)

    data = commands.add_parser("data", help="check or preview the training data of a config")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    check = data_commands.add_parser(
        "check",
        help="report samples read, dropped by reason, lengths and padding; exit 1 if nothing trains",
        epilog="example:\n  tuneforge data check configs/demo.yaml data.max_length=32",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("config", type=Path, help="YAML config file")
    check.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    preview = data_commands.add_parser(
        "preview",
        help="show rendered samples with the trained tokens highlighted",
        epilog="example:\n  tuneforge data preview configs/demo.yaml -n 3 | less",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    preview.add_argument("config", type=Path, help="YAML config file")
    preview.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    preview.add_argument("-n", type=_int_from(1), default=3, help="how many samples (default 3)")

    xtuner = commands.add_parser(
        "import-xtuner",
        help="convert an xtuner 0.1.x Python config to a tuneforge YAML config (read, never executed)",
        epilog="examples:\n  tuneforge import-xtuner my_xtuner_cfg.py -o my.yaml --deepspeed deepspeed_zero3_offload\n"
        "  tuneforge train my_xtuner_cfg.py --deepspeed deepspeed_zero3_offload --nproc-per-node 8  (and train)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    xtuner.add_argument("config", type=Path, help="xtuner config (.py)")
    xtuner.add_argument("-o", "--out", type=Path, help="write the YAML here (default: print only)")
    xtuner.add_argument(
        "--deepspeed", metavar="PRESET", help="xtuner's --deepspeed preset, e.g. deepspeed_zero3_offload"
    )
    xtuner.add_argument("--nproc-per-node", type=_int_from(1), default=1, help="NPROC_PER_NODE of the xtuner launch")

    doctor = commands.add_parser(
        "doctor",
        help="check a config, its model and this machine for known-bad set-ups (also run by train)",
        epilog="examples:\n  tuneforge doctor my.yaml --nproc-per-node 8\n"
        "  tuneforge doctor my.yaml parallel.engine=fsdp\n"
        "  tuneforge doctor my.yaml --nproc-per-node 8 --gpu h100 --model-config llama-3-8b/config.json\n"
        "  tuneforge recipes show llama-3-8b-lora-1gpu     (the published shapes of common models ship with it)\n\n"
        "With --gpu (or on a GPU machine) it also estimates memory per GPU and time per step from the model's\n"
        "shapes, with the assumptions listed: a sizing estimate, not a measurement.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("config", type=Path, help="YAML config file")
    doctor.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    doctor.add_argument("--nproc-per-node", type=_int_from(1), default=1, help="processes per node it will run with")
    doctor.add_argument("--nnodes", type=_int_from(1), default=1, help="nodes it will run with")
    doctor.add_argument(
        "--gpu",
        choices=GPU_CHOICES,
        help="estimate memory and time for this GPU (default: this machine's GPU, if any)",
    )
    doctor.add_argument(
        "--model-config",
        type=Path,
        metavar="PATH",
        help="the model's config.json (or its directory): shapes without downloading; the tokenizer and data "
        "are then read only if they are on this machine",
    )

    diagnose = commands.add_parser(
        "diagnose",
        help="print a run's hang report, or dump a running job's stacks and collectives",
        epilog="examples:\n  tuneforge diagnose work_dirs/my\n  tuneforge diagnose --live work_dirs/my",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diagnose.add_argument("work_dir", type=Path, help="the run's work dir")
    diagnose.add_argument("--live", action="store_true", help="dump a running job without stopping it")

    plot = commands.add_parser(
        "plot",
        help="draw a run's loss and learning rate from its metrics.jsonl into a PNG (also done after training)",
        epilog="examples:\n  tuneforge plot work_dirs/demo\n  tuneforge plot work_dirs/demo --out /tmp/demo.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plot.add_argument("work_dir", type=Path, help="the run's work dir (works while it trains, too)")
    plot.add_argument("--out", type=Path, help="PNG to write (default: WORK_DIR/plot.png)")

    watch = commands.add_parser(
        "watch",
        help="a live view of a run: ranks, curves, throughput, ETA, the last sample chat, a diagnosis",
        epilog="examples:\n  tuneforge watch work_dirs/demo\n  tuneforge watch work_dirs/my --once\n\n"
        "Works from another terminal or node (shared filesystem) and after the run; it ends with the run:\n"
        "status 0 when it finished, 3 when it ended with a diagnosis, 1 when it ended with an error or its\n"
        "ranks stopped beating without finishing, 2 when the directory holds no run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    watch.add_argument("work_dir", type=Path, help="the run's work dir")
    watch.add_argument("--once", action="store_true", help="print the view once and exit")
    watch.add_argument("--interval", type=_positive_seconds, default=1.0, help="seconds between refreshes (default 1)")
    add_recipes_parser(commands, GPU_CHOICES)
    commands.add_parser(
        "config-docs",
        help="list every config key with its default and meaning",
        epilog="example:\n  tuneforge config-docs | grep train.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


IMPORTED_HEADER = "# tuneforge config imported from "


def _check_import_target(source: Path, out: Path) -> None:
    """`-o` never overwrites the xtuner config itself, nor a file that an import did not write."""
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        raise UserError(f"-o {out}: that is the xtuner config being imported; write the YAML elsewhere")
    if out.is_dir():
        raise UserError(f"-o {out}: a directory; give the YAML file to write, e.g. {out / (source.stem + '.yaml')}")
    if out.exists():
        try:
            first = out.read_text(encoding="utf-8", errors="replace").split("\n", 1)[0]
        except OSError:
            first = ""
        if not first.startswith(IMPORTED_HEADER):
            raise UserError(f"-o {out}: exists and was not written by import-xtuner; delete it or choose another path")


def _import_xtuner(source: Path, deepspeed: str | None, nproc: int, out: Path | None) -> Path | None:
    """Print the native equivalent of an xtuner config (and write it to `out`)."""
    from tuneforge.xtuner.mapping import import_config, to_yaml

    if out is not None:
        _check_import_target(source, out)
    result = import_config(source, deepspeed, nproc)
    text = to_yaml(result, source, out)
    print(text)
    if result.unmapped:
        print(f"{len(result.unmapped)} setting(s) not mapped: the NOT MAPPED lines above say which and why")
    if out is None:
        return None
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)  # several ranks started by torchrun may write it at once
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise UserError(f"{out}: cannot write the imported config ({exc.strerror or exc}); choose another -o") from None
    print(f"written to {out}; run it with: {result.launch.replace('OUT.yaml', str(out))}")
    return out


def _train(args: argparse.Namespace) -> int:
    from tuneforge.config import load_config

    work_dir = args.work_dir or Path("work_dirs") / args.config.stem
    if args.config.suffix == ".py":
        imported = work_dir / "imported-xtuner.yaml"
        args.config = _import_xtuner(args.config, args.deepspeed, args.nproc_per_node, imported)
    elif args.deepspeed:
        raise UserError("--deepspeed names an xtuner preset and goes with an xtuner .py config; use parallel.* keys")
    config = load_config(args.config, args.overrides)  # validated before anything heavy is imported
    from tuneforge.distributed import launched_by_torchrun

    if args.nproc_per_node * args.nnodes > 1 and not launched_by_torchrun():
        from tuneforge.train.inputs import check_inputs

        check_inputs(config, work_dir)  # one message here, not one per rank after their start-up
        # The launcher imports no model code: the workers start seconds sooner and share the cores less.
        from tuneforge.launch import launch_workers

        worker_argv = ["train", str(args.config), *args.overrides, "--work-dir", str(work_dir)]
        if args.resume:
            worker_argv += ["--resume", args.resume]
        if args.archive_previous:
            worker_argv.append("--archive-previous")
        if args.allow_reward_code:
            worker_argv.append("--allow-reward-code")
        return launch_workers(
            worker_argv,
            args.nproc_per_node,
            args.nnodes,
            args.node_rank,
            args.master_addr,
            args.master_port,
            work_dir,
        )
    from tuneforge.errors import StoppedBySignal
    from tuneforge.train.run import run_training

    if args.allow_reward_code:
        from tuneforge.objective.rewards import ALLOW_REWARD_CODE

        os.environ[ALLOW_REWARD_CODE] = "1"  # this process's run (and only it) may import python rewards
    try:
        run_training(config, work_dir, args.resume, args.archive_previous)
    except StoppedBySignal as stopped:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"tuneforge: {stopped}", file=sys.stderr)
            print(f"resume with: {_resume_command(args, work_dir)}", file=sys.stderr)
        return stopped.exit_code
    return 0


def _resume_command(args: argparse.Namespace, work_dir: Path) -> str:
    """The command that continues this run: its config, overrides and process counts, with --resume auto."""
    import shlex

    words = ["tuneforge", "train", str(args.config), *args.overrides, "--work-dir", str(work_dir), "--resume", "auto"]
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        words += ["--nproc-per-node", str(local)]
        if world > local:
            words += ["--nnodes", str(world // local), "--node-rank", "N", "--master-addr", "ADDR"]
    return shlex.join(words)


def _doctor(args: argparse.Namespace) -> int:
    from tuneforge.doctor_report import print_doctor

    return print_doctor(args.config, args.overrides, args.nproc_per_node, args.nnodes, args.gpu, args.model_config)


def _data(args: argparse.Namespace) -> int:
    from tuneforge.config import load_config

    config = load_config(args.config, args.overrides)
    from rich.console import Console

    from tuneforge.train.inputs import check_data_inputs

    check_data_inputs(config)
    from tuneforge.data.loader import padding_by_strategy
    from tuneforge.data.pipeline import prepare_data
    from tuneforge.data.preview import show
    from tuneforge.data.prompts import room_for
    from tuneforge.data.report import format_report, nothing_trains
    from tuneforge.model.build import build_tokenizer
    from tuneforge.train.vision import data_view

    tokenizer, template, images = data_view(config, build_tokenizer(config.model))
    prepared = prepare_data(
        config.data, tokenizer, template, pairs=config.paired, images=images, prompt_room=room_for(config)
    )
    if args.data_command == "preview":
        if len(prepared.train.data) == 0:
            print("\n".join(format_report(prepared.train.report)))
            print(f"error: {nothing_trains(prepared.train.report)}", file=sys.stderr)
            return 1
        # Pairs show as their chosen answer, then their rejected one: -n counts pairs.
        count = args.n * (2 if config.paired else 1)
        image_token = images.image_token_id if images is not None else None
        show(tokenizer, prepared.train.data, count, Console(highlight=False), image_token)
        return 0
    for split in (prepared.train, prepared.validation):
        if split is None:
            continue
        if not config.paired:  # a pair's answers always share a row: these strategies do not apply
            split.report.padding = padding_by_strategy(
                split.data, config.train.micro_batch_size, config.data.max_length
            )
        print("\n".join(format_report(split.report)))
    if len(prepared.train.data) == 0:
        print(f"error: {nothing_trains(prepared.train.report)}", file=sys.stderr)
        return 1
    return 0


def command() -> int:
    """The `tuneforge` program: `main` on the command line's arguments, then a quick exit."""
    code = main()
    # The interpreter's shutdown would walk every object that torch and transformers created on import (about a
    # second per process, paid by each rank of every run); frozen, the collector leaves them to the OS.
    gc.freeze()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # Overrides may come after options too (`train cfg.yaml --work-dir d a.b=1`): collect the rest.
    args, rest = parser.parse_known_args(argv)
    with_overrides = ("train", "data", "doctor")
    if rest and (args.command not in with_overrides or any("=" not in r or r.startswith("-") for r in rest)):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in with_overrides:
        args.overrides = [*args.overrides, *rest]
    if args.command == "train" and args.node_rank >= args.nnodes:
        parser.error(
            f"--node-rank {args.node_rank} is beyond --nnodes {args.nnodes}: node ranks go 0..{args.nnodes - 1}"
        )
    if args.command == "train":
        from tuneforge.launcher_watch import follow_launcher

        follow_launcher()  # first: a worker whose launcher is killed during its start-up goes too
    if args.command == "eval":
        from tuneforge.launcher_watch import follow_parent_if_asked

        follow_parent_if_asked()  # a checkpoint's scoring ends with the training run that started it
    try:
        if args.command == "train":
            return _train(args)
        elif args.command == "chat":
            from tuneforge.chat import run_chat

            run_chat(
                args.checkpoint,
                args.prompt,
                args.system,
                args.template,
                args.max_new_tokens,
                args.base,
                args.trust_remote_code,
                args.image,
            )
        elif args.command == "export" and args.server is not None:
            from tuneforge.serve_layout import export_for_server

            if args.merge or args.format != "hf" or args.dtype:
                raise UserError("export --for writes an adapter as it was trained: drop --merge, --format and --dtype")
            for line in export_for_server(args.checkpoint, args.out, args.server, args.base):
                print(line)
        elif args.command == "export" and args.format == "gguf":
            from tuneforge.gguf_export.export import export_gguf

            if args.dtype:
                raise UserError(
                    "export --format gguf: the weight type is --outtype (f32, f16, bf16, q8_0), not --dtype"
                )
            for line in export_gguf(args.checkpoint, args.out, args.outtype, args.base, args.trust_remote_code):
                print(line)
        elif args.command == "export":
            from tuneforge.export import export

            for line in export(args.checkpoint, args.out, args.merge, args.dtype, args.base, args.trust_remote_code):
                print(line)
        elif args.command == "eval":
            from tuneforge.lm_eval_run import run_eval

            run_eval(
                args.target,
                args.tasks,
                args.limit,
                args.out,
                args.base,
                not args.no_base,
                args.batch_size,
                args.device,
                args.dtype,
                args.trust_remote_code,
            )
        elif args.command == "import-xtuner":
            _import_xtuner(args.config, args.deepspeed, args.nproc_per_node, args.out)
        elif args.command == "doctor":
            return _doctor(args)
        elif args.command == "diagnose":
            from tuneforge.diagnose import last_report, live_dump

            print(live_dump(args.work_dir) if args.live else last_report(args.work_dir))
        elif args.command == "plot":
            from tuneforge.train.plot import plot_metrics

            print(plot_metrics(args.work_dir, args.out))
        elif args.command == "data":
            return _data(args)
        elif args.command == "watch":
            from tuneforge.watch import watch

            return watch(args.work_dir, args.interval, args.once)
        elif args.command == "recipes":
            return run_recipes(args)
        elif args.command == "config-docs":
            from tuneforge.config.load import describe_fields

            print("\n".join(describe_fields()))
    except UserError as exc:
        from tuneforge.errors import say_user_error

        say_user_error(exc)  # once per launch, however many ranks met it
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
