"""`tuneforge eval`: a checkpoint, an adapter, a merged or a base model scored by lm-evaluation-harness in this
process, with the chat template the run trained with, beside the model training started from.

An adapter is applied in process (tuneforge's own loader, as `chat` and `export` use) and scored twice on the same
weights: with its adapters enabled (trained) and disabled (base). Before anything is scored, one forward through
the harness's own model call is made both ways: if the logits are equal the adapter would be ignored, and the
command refuses rather than report the base model's score as the trained one's.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tuneforge.errors import UserError, first_line
from tuneforge.lm_eval_tasks import LM_EVAL_RESULT, TASK_SUFFIXES, parse_tasks, require_harness

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROBE = "The quick brown fox jumps over the lazy dog. 0123456789"
"""The user message of the adapter check's forward pass (any text: an adapter that trained changes its logits)."""


def task_manager(specs: list[str]):
    """The harness's task index. Its built-in tasks (thousands of files, seconds to index) are read only when a
    task is named; local task files alone need none of them. Names the index lacks are refused here, before any
    model loads."""
    from lm_eval.tasks import TaskManager

    names = [spec for spec in specs if not spec.endswith(TASK_SUFFIXES)]
    manager = TaskManager(include_defaults=bool(names))
    for name in names:
        if name not in manager.task_index:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UserError(
                f"--tasks: {name}: not a task, group or tag of lm-evaluation-harness{hint} (`lm_eval ls tasks` "
                "lists them; a local task is given by its YAML file's path)"
            )
    return manager


@contextlib.contextmanager
def harness_errors():
    """What the harness raises for a task it cannot build (a task file it cannot read or parse, data it cannot
    find or fetch offline) as one line."""
    try:
        yield
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"lm-evaluation-harness: {type(exc).__name__}: {first_line(exc, 300)}") from None


def check_tasks(manager: Any, specs: list[str]) -> None:
    """Each task built once (its data read, or fetched into the cache), so a task that cannot be scored is said
    before any model loads."""
    with _quiet_harness(), harness_errors():
        manager.load(list(specs))


def run_directory(target: Path) -> tuple[Path, Path | None]:
    """The checkpoint `target` names and the work dir of the run that wrote it (None outside a run): a run's work
    dir stands for its final checkpoint."""
    from tuneforge.run_files import CHECKPOINTS, CONFIG

    if (target / CHECKPOINTS).is_dir() and (target / CONFIG).is_file():
        final = target / CHECKPOINTS / "final"
        if not final.is_dir():
            steps = sorted(p.name for p in (target / CHECKPOINTS).glob("step-*"))
            listed = f" (it has {', '.join(steps)})" if steps else ""
            raise UserError(f"{target}: the run has no final checkpoint{listed}; pass the checkpoint to score")
        return final, target
    parent = target.resolve().parent
    if parent.name == CHECKPOINTS and (parent.parent / CONFIG).is_file():
        return target, parent.parent
    return target, None


def check_out(out: Path) -> None:
    from tuneforge.train.inputs import writable_problems

    if out.is_dir():
        raise UserError(f"--out {out}: a directory; give the JSON file to write, e.g. {out / 'lm_eval.json'}")
    if problems := writable_problems("--out", out.parent):
        raise UserError(problems[0])


@dataclass
class Model:
    """One model to score."""

    model: Any
    tokenizer: Any
    disabled_adapters: bool = False
    """Scored with the adapters of `model` (a PeftModel) disabled: the base, on the same weights."""


@dataclass
class Scoring:
    """What each model is scored with: the tasks, the harness's settings, the chat template."""

    specs: list[str]
    limit: int | None
    batch_size: int
    chat: bool
    manager: Any = None


def harness_model(model: Any, tokenizer: Any, batch_size: int):
    """The harness's Hugging Face model around a model object: no copy, no reload; an adapter stays applied."""
    from lm_eval.models.huggingface import HFLM

    with _quiet_harness():
        return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def check_adapter_applies(lm: Any, peft_model: Any, chat: bool) -> float:
    """One forward through the harness's model call with the adapters enabled and disabled; the largest change
    of a logit, or UserError when there is none (the harness would score the base model as the trained one)."""
    text = PROBE
    if chat:
        text = lm.apply_chat_template([{"role": "user", "content": PROBE}])
    ids = torch.tensor([lm.tok_encode(text)], device=lm.device)
    with torch.no_grad():
        enabled = lm._model_call(ids).float()
        with peft_model.disable_adapter():
            disabled = lm._model_call(ids).float()
    change = (enabled - disabled).abs().max().item()
    if not change > 0:
        raise UserError(
            "the adapter changes no logit of the model it is applied to (one forward through the harness with the "
            "adapters enabled and disabled gave equal logits): its scores would be the base model's. Its weights "
            "are zero (saved before any step trained?) or apply to no layer the model runs; score another checkpoint"
        )
    return change


def score(entry: Model, scoring: Scoring) -> dict[str, Any]:
    """The harness's results for one model (`simple_evaluate`'s dictionary, without per-sample records)."""
    import lm_eval

    lm = harness_model(entry.model, entry.tokenizer, scoring.batch_size)
    disabled = entry.model.disable_adapter() if entry.disabled_adapters else contextlib.nullcontext()
    with disabled, _quiet_harness(), harness_errors():
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(scoring.specs),
            task_manager=scoring.manager,
            limit=scoring.limit,
            apply_chat_template=scoring.chat,
            log_samples=False,
        )
    if results is None:  # not rank 0 of a distributed harness run; this process is alone
        raise UserError("lm-evaluation-harness returned no results")
    return results


@contextlib.contextmanager
def _quiet_harness():
    """Without the harness's warning that a model object (not a name) was passed: that is what tuneforge does."""
    import logging

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            return "`pretrained` model kwarg is not of type" not in message and "already-initialized" not in message

    loggers = [logging.getLogger(name) for name in ("lm_eval", "lm-eval", "lm_eval.models.huggingface")]
    drop = Drop()
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


SKIPPED_FIELDS = {"alias", "name", "sample_len", "sample_count", "samples"}


def metric_rows(results: dict[str, Any]) -> list[tuple[str, str, float, float | None]]:
    """(task, metric, value, stderr) for each number the harness reported, groups and tasks alike."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key in SKIPPED_FIELDS or "_stderr" in key or isinstance(value, bool):
                continue
            if not isinstance(value, int | float):
                continue
            metric, _, filt = key.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            stderr = float(stderr) if isinstance(stderr, int | float) and math.isfinite(stderr) else None
            label = metric if filt in ("", "none") else f"{metric} ({filt})"
            rows.append((task, label, float(value), stderr))
    return rows


def _figure(value: float) -> str:
    """Four decimals, or four significant digits for a number too large for them (a perplexity)."""
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"


def side_by_side(trained: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """The console table: each task's metrics, base and trained side by side, and the change."""

    def number(value: float | None, stderr: float | None = None) -> str:
        if value is None:
            return "-"
        return _figure(value) + (f" ± {_figure(stderr)}" if stderr else "")

    before = {(task, metric): (value, stderr) for task, metric, value, stderr in metric_rows(base or {})}
    header = ["task", "metric", "base", "trained", "change"] if base is not None else ["task", "metric", "score"]
    table = [header]
    for task, metric, value, stderr in metric_rows(trained):
        if base is None:
            table.append([task, metric, number(value, stderr)])
            continue
        old, old_err = before.get((task, metric), (None, None))
        change = "-" if old is None else ("+" if value >= old else "-") + _figure(abs(value - old))
        table.append([task, metric, number(old, old_err), number(value, stderr), change])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]


def write_results(out: Path, trained: dict[str, Any], base: dict[str, Any] | None, about: dict[str, Any]) -> None:
    """The trained model's results in the harness's own layout (what `lm_eval --output_path` writes), the base
    model's under `base`, and what was scored under `tuneforge`."""
    from lm_eval.utils import handle_non_serializable

    record = {**trained, "base": base, "tuneforge": about}
    text = json.dumps(record, indent=2, default=handle_non_serializable, ensure_ascii=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise UserError(f"--out {out}: cannot be written ({exc.strerror or exc})") from None


def _fresh_base(work_dir: Path, tokenizer: Any, device: torch.device):
    """The model a run with a fresh architecture started from: initialised again from its config and seed."""
    from tuneforge.config import load_config
    from tuneforge.distributed import DistInfo
    from tuneforge.model.build import build_model
    from tuneforge.run_files import RunFiles

    cfg = load_config(RunFiles(work_dir).config)
    info = DistInfo(0, 1, 0, device)
    model = build_model(cfg.model.model_copy(update={"lora": None}), tokenizer, cfg.train.seed, info)
    return model, f"a fresh {cfg.model.architecture} initialised from the run's config (seed {cfg.train.seed})"


def base_source(work_dir: Path | None, base: Path | None) -> str | None:
    """Where the base model of a full checkpoint comes from: `--base`, else the run's `model.path` (a directory or
    a hub id), `fresh` for a fresh architecture; None when there is none to compare with."""
    if base is not None:
        if not base.is_dir():
            raise UserError(f"--base {base}: no such model directory")
        return str(base)
    if work_dir is None:
        return None
    from tuneforge.config import load_config
    from tuneforge.run_files import RunFiles

    try:
        cfg = load_config(RunFiles(work_dir).config)
    except UserError as exc:
        raise UserError(f"the base model is named by the run's config, which cannot be read: {exc}") from None
    if cfg.model.architecture is not None:
        return "fresh"
    path = cfg.model.path
    if path is not None and not Path(path).is_dir():  # a hub id: said now if this machine cannot load it
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(path, trust_remote_code=False)
        except OSError as exc:
            raise UserError(
                f"the run's base model {path} (model.path) is not available here ({first_line(exc)}); pass "
                "--base DIR with it, or --no-base"
            ) from None
        except ValueError:  # its own code: loaded (and refused or not) by the base's loader
            pass
    return path


def _load_base(source: str, tokenizer: Any, work_dir: Path | None, device: torch.device, trust_remote_code: bool):
    """The base model for a full checkpoint, float32 (as `load_trained` loads the trained one)."""
    if source == "fresh":
        assert work_dir is not None
        return _fresh_base(work_dir, tokenizer, device)
    from tuneforge.model.build import model_class
    from tuneforge.trained import allow_remote_code, loading

    remote = allow_remote_code(source, trust_remote_code) if Path(source).is_dir() else trust_remote_code
    with loading("base model", source):
        model = model_class(False).from_pretrained(source, dtype=torch.float32, trust_remote_code=remote)
    return model.eval(), source


def template_said(spec: Any, chat: bool) -> str:
    """What the prompts are rendered with, in a line."""
    if not chat:
        return "chat template: none recorded (no tuneforge.json); prompts as the tasks write them"
    if spec == "tokenizer":
        return "chat template: the tokenizer's own (as in training), applied to every prompt"
    name = f"{spec!r}" if isinstance(spec, str) else "inline"
    return f"chat template: the run's ({name}), applied to every prompt as in training"


def placed(model: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """`model` on `device` in `dtype`; k-bit weights (a QLoRA adapter's base) keep their storage."""
    if getattr(model, "is_quantized", False) or getattr(model, "quantization_method", None):
        return model.to(device)
    return model.to(device, dtype)


def run_eval(
    target: Path,
    tasks: str,
    limit: int | None = None,
    out: Path | None = None,
    base: Path | None = None,
    compare: bool = True,
    batch_size: int = 16,
    device: str | None = None,
    dtype: str = "fp32",
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """`tuneforge eval`: scores `target` (and its base, unless not `compare`), prints the table, writes `out`;
    returns what was written."""
    require_harness()
    specs = parse_tasks(tasks)
    checkpoint, work_dir = run_directory(target)
    if out is None:
        if work_dir is None:
            raise UserError(
                f"{target}: not a checkpoint of a run's work dir, so there is no default place for the results; "
                "pass --out FILE"
            )
        out = work_dir / LM_EVAL_RESULT
    check_out(out)

    from tuneforge.export import attach_chat_template
    from tuneforge.trained import is_adapter, is_reward_model, is_vision_checkpoint, load_trained

    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint}: no such model directory")
    if is_reward_model(checkpoint):
        raise UserError(f"{checkpoint}: a reward model scores conversations and writes no text; the tasks need an LM")
    adapter = is_adapter(checkpoint)
    if is_vision_checkpoint(checkpoint):
        raise UserError(f"{checkpoint}: a vision-language model; tuneforge eval scores text models")
    source = None
    if compare and not adapter:
        source = base_source(work_dir, base)
    manager = task_manager(specs)
    check_tasks(manager, specs)

    place = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    trained = load_trained(checkpoint, base if adapter else None, trust_remote_code=trust_remote_code)
    model, tokenizer = placed(trained.model, place, DTYPES[dtype]), trained.tokenizer
    attach_chat_template(tokenizer, trained.meta)
    chat = trained.meta.get("template") is not None and tokenizer.chat_template is not None
    template_note = template_said(trained.meta.get("template"), chat)
    print(template_note)
    scoring = Scoring(specs, limit, batch_size, chat, manager)
    about: dict[str, Any] = {
        "target": str(checkpoint.resolve()),
        "tasks": specs,
        "limit": limit,
        "chat_template": template_note,
        "device": str(place),
        "dtype": dtype,
    }

    base_results = None
    if adapter:
        lm = harness_model(model, tokenizer, batch_size)
        change = check_adapter_applies(lm, model, chat)
        print(f"adapter: applied in process; it changes the logits by up to {change:.3g} (checked before scoring)")
        about["adapter_check"] = {"max_logit_change": change, "probe": PROBE}
        if compare:
            about["base"] = f"{trained.base} (the adapter's base: its adapters disabled)"
            print(f"scoring the base: {trained.base}, the adapters disabled")
            base_results = score(Model(model, tokenizer, disabled_adapters=True), scoring)
        print(f"scoring the trained model: {checkpoint}")
        results = score(Model(model, tokenizer), scoring)
    else:
        print(f"scoring: {checkpoint}")
        results = score(Model(model, tokenizer), scoring)
        del model, trained
        if source is not None:
            base_model, described = _load_base(source, tokenizer, work_dir, place, trust_remote_code)
            print(f"scoring the base: {described}")
            about["base"] = described
            base_results = score(Model(placed(base_model, place, DTYPES[dtype]), tokenizer), scoring)
            del base_model
        elif compare:
            print("base: none to compare with (not a run's checkpoint and no --base DIR)")
    write_results(out, results, base_results, about)
    print()
    for line in side_by_side(results, base_results):
        print(line)
    print(f"\nresults (lm-evaluation-harness's layout, the base's under `base`): {out}")
    return {**results, "base": base_results, "tuneforge": about}
