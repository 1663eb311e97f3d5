"""What a step checkpoint holds beyond the model, so a run resumes exactly where it stopped.

`training_state/` inside `checkpoints/step-N/`: `state.json` (step, epoch, samples consumed, the world size
and batch shape it was written with), each rank's RNG states, and the engine's own state (model and
optimizer: one file for single/DDP, PyTorch distributed checkpoint shards for FSDP2, DeepSpeed's format for
ZeRO). The learning-rate schedule is a function of the step, and the data order a function of seed and
epoch, so neither needs saving.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tuneforge.checkpoint_records import QUANTIZED_EXPERTS, checkpoint_problems, read_chat_meta
from tuneforge.config.schema import QuantizationConfig
from tuneforge.errors import UserError, first_line
from tuneforge.run_files import RunFiles
from tuneforge.train.checkpoint import step_checkpoints

TRAINING_STATE = "training_state"
STATE_FILE = "state.json"


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """Where a run stood after a step, and the settings it was written with (`state.json`, by field name)."""

    step: int
    epoch: int
    samples_consumed: int
    world_size: int
    micro_batch_size: int
    gradient_accumulation: int
    engine: str
    best_val_loss: float | None = None
    run_id: str | None = None
    """The run that wrote it (None: written before runs were recorded)."""
    sequence_parallel: int = 1
    """Ranks per sample: the data-parallel size, and so the data plan, is world_size / sequence_parallel."""
    train_data: str | None = None
    """`TokenizedData.signature()` of the training split it was written with (None: written before it was)."""
    expert_parallel: int = 1
    """Ranks each MoE layer's experts are split over: the engine's checkpoint files are written per expert shard."""
    precision: str | None = None
    """The precision the run computed in (`train.precision`, `auto` resolved); None: written before it was."""
    data_plan: str | None = None
    """The settings the data's order follows (`tuneforge.data.loader.data_plan`); None: written before it was."""


RNG_FILE = "rng-rank-{rank}.safetensors"
LEGACY_RNG_FILE = "rng-rank-{rank}.pt"
"""Written before 0.x checkpoints held only data: a pickle, read with PyTorch's weights-only loader."""


def save_rng(directory: Path, rank: int) -> None:
    """Every generator's state as data (safetensors: tensors, and JSON for the scalars), so reading a checkpoint
    someone handed over never unpickles anything."""
    version, internal, gauss_next = random.getstate()
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    tensors = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(internal, dtype=torch.int64),
        "numpy": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
    }
    if torch.cuda.is_available():
        tensors.update({f"cuda.{index}": state for index, state in enumerate(torch.cuda.get_rng_state_all())})
    scalars = {
        "python": json.dumps([version, gauss_next]),
        "numpy": json.dumps([name, int(position), int(has_gauss), float(cached_gaussian)]),
    }
    save_file(tensors, directory / RNG_FILE.format(rank=rank), metadata=scalars)


def load_rng(directory: Path, rank: int) -> None:
    path = directory / RNG_FILE.format(rank=rank)
    if not path.exists() and (directory / LEGACY_RNG_FILE.format(rank=rank)).exists():
        _set_rng(_legacy_rng(directory / LEGACY_RNG_FILE.format(rank=rank)))
        return
    try:
        with safe_open(path, framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
            scalars = handle.metadata() or {}
        version, gauss_next = json.loads(scalars["python"])
        name, position, has_gauss, cached_gaussian = json.loads(scalars["numpy"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = first_line(exc)
        raise UserError(f"--resume: {path} is not readable ({reason}); resume from another checkpoint") from None
    cuda = [tensors[f"cuda.{index}"] for index in range(len(tensors)) if f"cuda.{index}" in tensors]
    try:
        _set_rng(
            {
                "torch": tensors["torch"],
                "cuda": cuda or None,
                "python": (version, tuple(tensors["python"].tolist()), gauss_next),
                "numpy": (name, tensors["numpy"].numpy().astype(np.uint32), position, has_gauss, cached_gaussian),
            }
        )
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:  # states of another shape than written
        reason = first_line(exc)
        raise UserError(f"--resume: {path} holds no usable generator states ({reason})") from None


def _legacy_rng(path: Path) -> dict:
    """An RNG file of an older tuneforge: PyTorch's weights-only unpickler with numpy's array types allowed,
    which imports nothing else; anything more is refused."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True)
    except Exception:  # UnpicklingError and whatever a foreign file raises
        # torch's own message ends by advising weights_only=False, the one thing never to do with this file.
        raise UserError(
            f"--resume: {path} holds more than random-generator states; tuneforge does not load files that could "
            "run code. Resume from a checkpoint you wrote, or start a new run"
        ) from None


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def write_state(directory: Path, point: ResumePoint) -> None:
    (directory / STATE_FILE).write_text(json.dumps(asdict(point), indent=2))


def read_state(checkpoint: Path) -> ResumePoint:
    path = checkpoint / TRAINING_STATE / STATE_FILE
    if not path.exists():
        raise UserError(
            f"--resume {checkpoint}: no {TRAINING_STATE}/{STATE_FILE}; only checkpoints/step-N directories written "
            "by tuneforge train can be resumed"
        )
    try:
        recorded = json.loads(path.read_text())
        known = {f.name for f in fields(ResumePoint)}
        point = ResumePoint(**{key: value for key, value in recorded.items() if key in known})
        _check_types(point)
        return point
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # cut short, edited, or not ours
        reason = first_line(exc)
        raise UserError(f"--resume {checkpoint}: {path} is not readable ({reason}); take another checkpoint") from None


def check_same_data_plan(point: ResumePoint, checkpoint: Path, now: str) -> None:
    """The step a checkpoint records is a position in its data plan: under another seed or way of forming rows
    the same position holds other samples, so some would be skipped and others seen twice."""
    if point.data_plan is not None and point.data_plan != now:
        raise UserError(
            f"--resume {checkpoint}: written with {point.data_plan}; this run has {now}. The data's order follows "
            "them, so going on from its step would skip some samples and repeat others: resume with the same "
            "settings, or begin a new run from this checkpoint's weights"
        )


def data_changed_note(point: ResumePoint, checkpoint: Path, now: str, steps_per_epoch: int) -> str | None:
    """What a resume does when the training data is not what the checkpoint was trained on (`now`: the
    signature of this run's split), or None when it is the same or unknown."""
    if point.train_data is None or point.train_data == now:
        return None
    then_count, now_count = point.train_data.split(":")[0], now.split(":")[0]
    if not then_count.isdigit():
        then_count = "?"
    epoch, into = divmod(point.step, steps_per_epoch)
    return (
        f"resume: the training data changed since {checkpoint} was written ({then_count} samples then, "
        f"{now_count} now, or their lengths differ): the run continues after step {point.step} by the new "
        f"data's plan, at epoch {epoch}, step {into + 1} of {steps_per_epoch} in it, so samples of the new data may "
        "be skipped or seen twice this epoch. To train on the new data from its start, begin a new run from "
        "this checkpoint's weights instead"
    )


COUNTS = ("step", "epoch", "samples_consumed")
SIZES = ("world_size", "micro_batch_size", "gradient_accumulation", "sequence_parallel", "expert_parallel")


def _check_types(point: ResumePoint) -> None:
    """A state file edited by hand or by someone else: every number where the loop expects one."""
    for name in COUNTS + SIZES:
        value = getattr(point, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < (name in SIZES):
            raise ValueError(f"{name} is {value!r}, not a whole number of at least {int(name in SIZES)}")
    if not isinstance(point.engine, str):
        raise ValueError(f"engine is {point.engine!r}, not a name")
    loss = point.best_val_loss
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, int | float)):
        raise ValueError(f"best_val_loss is {loss!r}, not a number")
    for name in ("run_id", "train_data", "precision", "data_plan"):
        if getattr(point, name) is not None and not isinstance(getattr(point, name), str):
            raise ValueError(f"{name} is {getattr(point, name)!r}, not text")
    if point.precision not in (None, "fp32", "bf16", "fp16"):
        raise ValueError(f"precision is {point.precision!r}, not one of train.precision's fp32, bf16, fp16")


def find_resume(
    work_dir: Path, requested: str | None, run_id: str | None = None, notes: list[str] | None = None
) -> Path | None:
    """`auto`: the newest complete step checkpoint of the work dir's run `run_id` (None when there is none); or
    a path. Checkpoints of another run (copied in, or left by one) are never continued by `auto`; newer ones
    found damaged are passed over, each with a line in `notes`."""
    if requested is None:
        return None
    if requested != "auto":
        path = Path(requested)
        read_state(path)
        if problems := checkpoint_problems(path):
            raise UserError(f"--resume {path}: damaged since it was written: {'; '.join(problems)}")
        return path
    for _, path in reversed(step_checkpoints(RunFiles(work_dir).checkpoints)):
        # Damaged ones are passed over whichever run wrote them: the record of the run may be what is damaged.
        problems = checkpoint_problems(path)
        written_by = None
        if not problems:
            try:
                written_by = read_state(path).run_id
            except UserError as exc:
                problems = [str(exc).removeprefix(f"--resume {path}: ").removesuffix("; take another checkpoint")]
        if problems:
            if notes is not None:
                notes.append(f"resume: passing over {path}: {'; '.join(problems)}")
            continue
        if run_id is None or written_by is None or written_by == run_id:
            return path
    return None


@dataclass(frozen=True)
class MustMatch:
    """A setting a step checkpoint records that a resumed run must share."""

    field: str
    """The `ResumePoint` field, and the keyword `check_compatible` takes this run's value by."""
    setting: str | None = None
    """The config setting said in its own message (`parallel.sequence_parallel`); None: said with the batch shape."""
    why: str = ""
    """Why it must match, for its own message."""


MUST_MATCH = (
    MustMatch("world_size"),
    MustMatch("micro_batch_size"),
    MustMatch("gradient_accumulation"),
    MustMatch("engine"),
    MustMatch(
        "sequence_parallel", "parallel.sequence_parallel", "the data-parallel size and so the order of the data differ"
    ),
    MustMatch("expert_parallel", "parallel.expert_parallel", "the engine's optimizer state is stored per expert shard"),
)
"""Sharded states and the data plan are tied to the world size and batch shape they were written with. The batch
shape (no `setting`) is said in one message; a field more is one line here and one keyword at the caller."""


def check_compatible(point: ResumePoint, checkpoint: Path, **this_run: object) -> None:
    """`point` against this run's value of every `MUST_MATCH` field, given by field name."""
    assert this_run.keys() == {match.field for match in MUST_MATCH}, sorted(this_run)
    shape = [match.field for match in MUST_MATCH if match.setting is None]
    if any(getattr(point, name) != this_run[name] for name in shape):
        now = this_run
        raise UserError(
            f"--resume {checkpoint}: written by {point.world_size} process(es) with engine {point.engine}, "
            f"micro-batch {point.micro_batch_size} and accumulation {point.gradient_accumulation}; this run has "
            f"{now['world_size']}, {now['engine']}, {now['micro_batch_size']} and {now['gradient_accumulation']}. "
            "Resume with the same settings (export the checkpoint and start a new run from it to change them)"
        )
    for match in MUST_MATCH:
        written = getattr(point, match.field)
        if match.setting is not None and written != this_run[match.field]:
            raise UserError(
                f"--resume {checkpoint}: written with {match.setting}={written}, this run has "
                f"{this_run[match.field]}: {match.why}. Resume with {match.setting}={written}"
            )


QUANTIZED_VALUES = ("bits", "skip_modules", "quant_type", "double_quant")
"""The model.quantization settings that decide the base weights' values (not how they are stored or computed);
the last two for 4 bits only."""


def check_same_quantization(checkpoint: Path, quantization: QuantizationConfig | None) -> None:
    """An adapter resumes against the base weights it trained on: k-bit values differ from full precision ones,
    so a resumed run on another quantization would not continue the interrupted one. Checked before loading."""
    adapter = (read_chat_meta(checkpoint) or {}).get("adapter")
    if adapter is None:
        return
    recorded = adapter.get("quantization")
    try:
        trained = QuantizationConfig.model_validate(recorded) if recorded is not None else None
    except ValueError:  # settings of another tuneforge version: not comparable field by field
        return
    if trained is None and quantization is None:
        return
    if trained is None or quantization is None:
        was = f"a {trained.bits}-bit base" if trained is not None else "an unquantized base"
        now = f"{quantization.bits} bits" if quantization is not None else "full precision"
        raise UserError(
            f"--resume {checkpoint}: its adapters trained on {was}, this run loads the base in {now}. Resume with "
            "the run's model.quantization (see config.tuneforge.yaml in the checkpoint)"
        )
    keys = QUANTIZED_VALUES if trained.bits == quantization.bits == 4 else ("bits", "skip_modules")
    changed = [
        f"{key} {getattr(trained, key)!r} -> {getattr(quantization, key)!r}"
        for key in keys
        if getattr(trained, key) != getattr(quantization, key)
    ]
    if changed:
        raise UserError(
            f"--resume {checkpoint}: model.quantization differs from the run's ({'; '.join(changed)}), which changes "
            "the base weights its adapters trained on. Resume with the run's settings"
        )


def check_same_expert_storage(checkpoint: Path, quantized_now: int) -> None:
    """An adapter resumes against the base weights it trained on: the same experts stored in 4 bits (their values
    differ from full precision ones, so the resumed run would not continue the interrupted one)."""
    adapter = (read_chat_meta(checkpoint) or {}).get("adapter")
    if adapter is None:
        return
    trained = adapter.get(QUANTIZED_EXPERTS, 0)  # absent: written before stacked experts were quantized
    if trained == quantized_now:
        return
    if trained == 0:
        raise UserError(
            f"--resume {checkpoint}: its adapters trained with the routed experts in full precision (written "
            f"before tuneforge stored stacked experts in 4 bits), but this run stores {quantized_now} experts "
            "module(s) in 4 bits. Add experts to model.quantization.skip_modules to resume as trained"
        )
    raise UserError(
        f"--resume {checkpoint}: its adapters trained with {trained} experts module(s) stored in 4 bits, this run "
        f"has {quantized_now} with the same model.quantization: the model loads with other code than in training "
        "(another transformers version). Resume in the training's environment"
    )
