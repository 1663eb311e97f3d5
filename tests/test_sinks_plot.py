"""TensorBoard and W&B (offline) mirror metrics.jsonl; plot.png is drawn at the end and by `tuneforge plot`."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys

import pytest

from tuneforge.cli import main
from tuneforge.config import load_config
from tuneforge.config.schema import LogConfig
from tuneforge.errors import UserError
from tuneforge.train.metrics import MetricsLog
from tuneforge.train.plot import plot_metrics
from tuneforge.train.run import run_training
from tuneforge.train.sinks import open_sinks, require_packages

from conftest import chat, write_jsonl

CONFIG = """\
model:
  architecture: llama
  size: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}
  tokenizer: bytes
data: {train_files: [train.jsonl], cache_dir: null, validation_fraction: 0.25}
train: {lr: 3.0e-3, micro_batch_size: 4, max_steps: 6, warmup_steps: 2, precision: fp32}
checkpoint: {every_steps: 0, save_final: false}
eval: {every_steps: 3}
log: {progress: lines, tensorboard: true, wandb: true, wandb_project: tuneforge-test}
"""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def wandb_env(monkeypatch, root) -> None:
    """Keep W&B's own settings, cache and messages inside the test's directory."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(root / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)


def scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def records(work_dir) -> list[dict]:
    return [json.loads(line) for line in (work_dir / "metrics.jsonl").open()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sinks")
    write_jsonl(root / "train.jsonl", [chat(f"question {i % 5}", f"answer {i % 5}") for i in range(24)])
    (root / "cfg.yaml").write_text(CONFIG)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(out):
        wandb_env(monkeypatch, root)
        run_training(load_config(root / "cfg.yaml"), root / "run")
    return root / "run", out.getvalue().splitlines()


@pytest.mark.slow
def test_tensorboard_has_every_step_with_the_values_of_metrics_jsonl(run):
    work_dir, _ = run
    logged = records(work_dir)
    for key in ("loss", "lr", "grad_norm"):
        assert scalars(work_dir / "tensorboard", key) == [
            (r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged
        ], key
    assert [step for step, _ in scalars(work_dir / "tensorboard", "val_loss")] == [3, 6]


@pytest.mark.slow
def test_wandb_offline_run_is_kept_in_the_work_dir(run):
    work_dir, _ = run
    run_id = (work_dir / "wandb" / "run-id").read_text().strip()
    (run_dir,) = (work_dir / "wandb").glob("offline-run-*")
    assert run_dir.name.endswith(run_id)
    run_file = run_dir / f"run-{run_id}.wandb"
    assert run_file.stat().st_size > 0


@pytest.mark.slow
def test_plot_is_drawn_at_the_end_and_the_summary_says_where(run):
    work_dir, lines = run
    png = work_dir / "plot.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 10_000
    assert f"plot: {png} (redraw: tuneforge plot {work_dir})" in lines
    assert lines.index(f"metrics: {work_dir / 'metrics.jsonl'}") < lines.index(
        f"plot: {png} (redraw: tuneforge plot {work_dir})"
    )


@pytest.mark.slow
def test_tuneforge_plot_redraws_it(run, tmp_path, capsys):
    work_dir, _ = run
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(work_dir / "metrics.jsonl", copy)
    assert main(["plot", str(copy)]) == 0
    assert capsys.readouterr().out.strip() == str(copy / "plot.png")
    assert (copy / "plot.png").read_bytes()[:8] == PNG_MAGIC
    assert main(["plot", str(copy), "--out", str(tmp_path / "elsewhere" / "p.png")]) == 0
    assert (tmp_path / "elsewhere" / "p.png").read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()
    (tmp_path / "a-file").write_text("")
    for out, said in ((tmp_path, "a directory; give the PNG file"), (tmp_path / "a-file" / "p.png", "cannot be")):
        assert main(["plot", str(copy), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_a_line_cut_off_by_a_crash_is_left_out_and_counted(run, tmp_path):
    work_dir, _ = run
    shutil.copy(work_dir / "metrics.jsonl", tmp_path)
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('\n{"step": 7, "epoch": 0, "lo')
    warnings: list[str] = []
    assert plot_metrics(tmp_path, warn=warnings.append) == tmp_path / "plot.png"
    assert len(warnings) == 1
    assert "1 unreadable line(s) left out of the plot (line 8)" in warnings[0]


def test_plot_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}: no metrics.jsonl here")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("sink", ["tensorboard", "wandb"])
def test_a_missing_sink_package_names_the_fix(monkeypatch, sink):
    monkeypatch.setitem(sys.modules, sink, None)  # makes `import <sink>` raise ImportError
    with pytest.raises(UserError) as error:
        require_packages(LogConfig(**{sink: True}))
    message = str(error.value)
    assert f"pip install 'tuneforge[{sink}]'" in message
    assert f"set log.{sink}: false" in message
    assert "\n" not in message
    require_packages(LogConfig())  # nothing enabled, nothing needed


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint_in_tensorboard(tmp_path):
    log = LogConfig(tensorboard=True)
    first = MetricsLog(tmp_path / "metrics.jsonl", sinks=open_sinks(log, tmp_path, {}))
    for step in range(1, 6):  # the interrupted run got to step 5; its last checkpoint was step 3
        first.write({"step": step, "loss": 1.0})
    first.close()
    resumed = MetricsLog(tmp_path / "metrics.jsonl", append=True, sinks=open_sinks(log, tmp_path, {}, start_step=3))
    for step in range(4, 7):
        resumed.write({"step": step, "loss": 2.0})
    resumed.close()
    assert scalars(tmp_path / "tensorboard", "loss") == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]


def test_a_failing_sink_is_dropped_with_a_warning_and_the_jsonl_goes_on(tmp_path, capsys):
    class Broken:
        name = "broken"
        writes = 0
        closed = False

        def write(self, step, scalars):
            Broken.writes += 1
            raise OSError("disk full")

        def close(self):
            Broken.closed = True

    log = MetricsLog(tmp_path / "metrics.jsonl", sinks=[Broken()])
    log.write({"step": 1, "loss": 1.0, "skipped": True})
    log.write({"step": 2, "loss": 0.5})
    log.close()
    assert Broken.writes == 1 and Broken.closed
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    assert "warning: broken logging stopped at step 1: OSError: disk full" in capsys.readouterr().err
