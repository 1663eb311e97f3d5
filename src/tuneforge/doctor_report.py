"""`tuneforge doctor` as a command: the config read, its tokenizer and data where they are on this machine,
the checks run for the machine named (or this one), and the report printed."""

from __future__ import annotations

from pathlib import Path

from tuneforge.config import load_config
from tuneforge.data.pipeline import prepare_data
from tuneforge.data.prompts import room_for
from tuneforge.doctor import FAIL, WARN, Check, doctor_engine, format_checks, run_checks
from tuneforge.errors import UserError
from tuneforge.estimate import ACCELERATORS
from tuneforge.model.build import build_tokenizer
from tuneforge.train.vision import data_view


def doctor_checks(
    config_path: Path,
    overrides: list[str],
    nproc_per_node: int,
    nnodes: int,
    gpu: str | None,
    model_config: Path | None,
) -> list[Check]:
    """The checks of a config for `nproc_per_node` x `nnodes` processes on `gpu` (None: this machine's GPU, if
    any). With `model_config` the model's shapes come from that file, and a tokenizer or data missing here is
    noted instead of refused: the job is sized for another machine."""
    config = load_config(config_path, overrides)
    world_size = nproc_per_node * nnodes
    accelerator = ACCELERATORS[gpu] if gpu else None
    engine = doctor_engine(config, world_size, accelerator)
    skipped = []
    tokenizer, num_samples = None, None
    try:
        tokenizer = build_tokenizer(config.model, local_files_only=model_config is not None)
    except OSError:
        source = config.model.tokenizer or config.model.path
        skipped.append(Check("tokenizer", WARN, f"{source} is not on this machine: template and data not checked"))
    if tokenizer is not None:
        try:
            tokenizer, template, images = data_view(config, tokenizer)
            data = prepare_data(config.data, tokenizer, template, 0, 1, config.paired, images, room_for(config))
            num_samples = data.training_units(config.paired)
        except UserError as exc:
            if model_config is None:
                raise
            skipped.append(Check("training data", WARN, f"not read: {exc}", "put the data in place before training"))
    checks = run_checks(config, engine, world_size, tokenizer, num_samples, model_config, accelerator, nproc_per_node)
    return [*skipped, *checks]


def print_doctor(
    config_path: Path,
    overrides: list[str],
    nproc_per_node: int,
    nnodes: int,
    gpu: str | None,
    model_config: Path | None,
) -> int:
    """Prints the report; 1 when a check fails."""
    checks = doctor_checks(config_path, overrides, nproc_per_node, nnodes, gpu, model_config)
    print(format_checks(checks))
    for check in checks:
        if check.report:
            print(check.report)
    return 1 if any(c.status == FAIL for c in checks) else 0
