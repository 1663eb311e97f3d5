"""Optional mirrors of `metrics.jsonl`: TensorBoard event files and Weights & Biases runs.

`metrics.jsonl` stays the record of a run; a sink receives the same numbers per optimizer step, with the
step as x axis, under the same names (`loss`, `lr`, `grad_norm`, ...). Sinks are opened on rank 0 only.
"""

from __future__ import annotations

import importlib
import secrets
import sys
from pathlib import Path
from typing import Any, Protocol

from tuneforge.config.schema import LogConfig
from tuneforge.errors import UserError

# log.<key> -> (module to import, extra that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
WANDB_ID_FILE = "run-id"  # under <work_dir>/wandb/


class MetricSink(Protocol):
    name: str

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record except the step itself; flags such as `skipped` become 0/1."""
    return {key: float(value) for key, value in record.items() if key != "step" and isinstance(value, int | float)}


def enabled_sinks(log: LogConfig) -> list[str]:
    return [name for name in PACKAGES if getattr(log, name)]


def require_packages(log: LogConfig) -> None:
    """Fail before the model loads when an enabled sink's package is missing (every rank, so none waits)."""
    for name in enabled_sinks(log):
        _import(name)


def _import(name: str) -> Any:
    module, extra = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UserError(
            f"log.{name} needs the {module} package ({exc}): pip install 'tuneforge[{extra}]' "
            f"(or set log.{name}: false)"
        ) from None


def open_sinks(log: LogConfig, work_dir: Path, run_config: dict[str, Any], start_step: int = 0) -> list[MetricSink]:
    """The sinks `log` enables. `run_config`: the resolved config, recorded with the W&B run; `start_step`: the
    step a resumed run continues after (0 for a fresh run)."""
    sinks: list[MetricSink] = []
    try:
        if log.tensorboard:
            sinks.append(TensorBoardSink(work_dir / "tensorboard", start_step))
        if log.wandb:
            sinks.append(WandbSink(log, work_dir, run_config))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path, start_step: int):
        _import("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run writes steps after `start_step` again; purge_step hides what the interrupted run had
        # logged from there on, so TensorBoard shows the same curve as the cut-back metrics.jsonl.
        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step > 0 else None)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crash keeps what was logged, as with metrics.jsonl

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per work dir: its id is kept in `<work_dir>/wandb/run-id` and a resumed run continues it.

    Online, the resumed process appends to the same run, so the chart is one curve. Offline, each process
    writes its own `offline-run-*` directory under the same id; `wandb sync` uploads them into that one run.
    Steps that an interrupted run had logged past its last checkpoint are logged again with equal values
    (resume is exact); W&B keeps one point per step.
    """

    name = "wandb"

    def __init__(self, log: LogConfig, work_dir: Path, run_config: dict[str, Any]):
        wandb = _import("wandb")
        root = work_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(
                project=log.wandb_project,
                name=work_dir.name,
                id=run_id,
                resume="allow",
                dir=str(work_dir),  # W&B adds the `wandb/` level itself
                mode=log.wandb_mode,
                config=run_config,
                # Our own console output stays as it is: no wrapping of stdout/stderr.
                settings=wandb.Settings(console="off"),
            )
        except Exception as exc:
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise UserError(
                f"log.wandb: W&B could not start a {log.wandb_mode} run: {first_line} "
                "(log.wandb_mode: offline needs no network or login)"
            ) from None

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def write_all(sinks: list[MetricSink], step: int, scalars: dict[str, float]) -> list[MetricSink]:
    """Write to every sink; the ones that fail are dropped with one warning line, since metrics.jsonl already
    has the record and a logging service should not end a run. Returns the sinks still working."""
    working = []
    for sink in sinks:
        try:
            sink.write(step, scalars)
        except Exception as exc:
            print(f"warning: {sink.name} logging stopped at step {step}: {type(exc).__name__}: {exc}", file=sys.stderr)
            close_all([sink])
            continue
        working.append(sink)
    return working


def close_all(sinks: list[MetricSink]) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:
            print(f"warning: closing {sink.name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
