"""What a training run needs of `tuneforge eval` (`eval.lm_eval`), without importing the model loaders that
import `train` back: the harness's presence, the tasks' check, and the scoring of a finished run's final
checkpoint in a process of its own (the training's memory freed, the harness's failures its own)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tuneforge.errors import UserError

LM_EVAL_RESULT = Path("eval") / "lm_eval.json"
"""Where the harness's results go, in the run's work dir."""
INSTALL = "pip install 'tuneforge[eval]'"
TASK_SUFFIXES = (".yaml", ".yml")


def require_harness() -> None:
    """lm-evaluation-harness is an optional extra: its absence is said before anything loads."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"tuneforge eval runs lm-evaluation-harness, which is not installed: {INSTALL}")


def parse_tasks(text: str) -> list[str]:
    """`--tasks`: harness task (or group, or tag) names and paths of local task YAML files, comma-separated; a
    path comes back absolute, so the harness reads the file named whatever directory it runs in."""
    specs = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        path = Path(item).expanduser()
        if item.endswith(TASK_SUFFIXES) or os.sep in item:
            if not path.is_file():
                raise UserError(f"--tasks: {item}: no such task file (a local task is a harness task YAML file)")
            specs.append(str(path.resolve()))
        else:
            specs.append(item)
    if not specs:
        raise UserError("--tasks: no task given; name harness tasks or local task YAML files, comma-separated")
    return specs


def check_settings(settings: Any) -> list[str]:
    """`eval.lm_eval` checked before a run trains (the harness installed, each local task file there); returns
    its tasks with the files' paths made absolute, as the run's resolved config records them."""
    require_harness()
    return parse_tasks(",".join(settings.tasks))


def eval_command(
    settings: Any,
    target: Path,
    device: str,
    trust_remote_code: bool = False,
    base: bool | None = None,
    dtype: str = "fp32",
) -> list[str]:
    """The `tuneforge eval` command line that scores `target` (a run's work dir: its final checkpoint; or a
    checkpoint) as `eval.lm_eval` asks; `base`: score the base beside it (default: the setting's)."""
    command = [sys.executable, "-m", "tuneforge", "eval", str(target), "--tasks", ",".join(settings.tasks)]
    command += ["--batch-size", str(settings.batch_size), "--device", device, "--dtype", dtype]
    if settings.limit is not None:
        command += ["--limit", str(settings.limit)]
    if not (settings.base if base is None else base):
        command.append("--no-base")
    if trust_remote_code:
        command.append("--trust-remote-code")
    return command


def score_after_training(settings: Any, work_dir: Path, device: str, trust_remote_code: bool = False) -> None:
    """`eval.lm_eval` at the end of a run: `tuneforge eval WORK_DIR` on its final checkpoint (the training chat
    template, the base beside it) into `WORK_DIR/eval/lm_eval.json`, its output shown here."""
    from tuneforge.run_files import RunFiles

    if not (RunFiles(work_dir).checkpoints / "final").is_dir():
        print("eval.lm_eval: no final checkpoint to score (checkpoint.save_final: false); skipped")
        return
    command = eval_command(settings, work_dir, device, trust_remote_code)
    print(f"eval.lm_eval: {' '.join(command[3:])}", flush=True)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            print(line, end="", flush=True)
    if child.returncode != 0:
        raise UserError(
            f"eval.lm_eval: tuneforge eval stopped with status {child.returncode} (its output is above); training "
            f"finished and its checkpoints are kept: score them again with `{' '.join(command[3:])}`"
        )
