"""`tuneforge eval`: lm-evaluation-harness in process on a checkpoint, an adapter (checked to change the logits
before it is scored), a merged or a base model, with local task files (offline) and the training chat template."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuneforge.errors import UserError

from conftest import DEMO_TEMPLATE, REPO, adapter_checkpoint, demo_tokenizer, tiny_llama, train_here, tuneforge_here

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional extra tuneforge[eval]")

HELD_OUT = REPO / "configs" / "data" / "hex_rgb_heldout.jsonl"

CHOICE_TASK = """task: hex_rgb_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{messages[0].content}}}}"
# The right triple first, then its complement (255 - each), each rotated: only a model that reads the hex picks it.
doc_to_choice: "{{% set c = messages[1].content[1:-1].split(', ') %}}
  {{% set d = [255 - c[0]|int, 255 - c[1]|int, 255 - c[2]|int] %}}{{{{ [
  '(' ~ c[0] ~ ', ' ~ c[1] ~ ', ' ~ c[2] ~ ')', '(' ~ d[0] ~ ', ' ~ d[1] ~ ', ' ~ d[2] ~ ')',
  '(' ~ c[1] ~ ', ' ~ c[2] ~ ', ' ~ c[0] ~ ')', '(' ~ d[2] ~ ', ' ~ d[0] ~ ', ' ~ d[1] ~ ')'] }}}}"
doc_to_target: 0
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
"""A multiple-choice task on the demo's held-out colours (loglikelihoods): the demo learns it within 100 steps."""

LIKELIHOOD_TASK = """task: hex_rgb_likelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{messages[0].content}}}}"
doc_to_target: "{{{{messages[1].content}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""
"""The perplexity of each held-out answer after its prompt: a continuous number, equal only where the prompts,
tokens and weights are."""


def write_task(directory: Path, text: str, name: str) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(text.format(data=HELD_OUT), encoding="utf-8")
    return path


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Nothing is fetched: the hub and datasets offline, the datasets cache in the test's directory."""
    import datasets.config
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_tasks_are_harness_names_and_local_task_files(tmp_path, monkeypatch):
    from tuneforge.lm_eval_tasks import parse_tasks

    task = write_task(tmp_path, CHOICE_TASK, "hex")
    monkeypatch.chdir(tmp_path)
    assert parse_tasks(" hellaswag, hex.yaml ,arc_easy,") == ["hellaswag", str(task), "arc_easy"]
    with pytest.raises(UserError, match=r"missing\.yaml: no such task file"):
        parse_tasks("hellaswag,missing.yaml")
    with pytest.raises(UserError, match="no task given"):
        parse_tasks(" , ")


def test_an_unknown_task_name_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import lm_eval.tasks

    from tuneforge.lm_eval_run import task_manager

    write_task(tmp_path, CHOICE_TASK, "hex")
    real = lm_eval.tasks.TaskManager
    # The harness's own index of thousands of tasks takes seconds to build: this one holds the local task alone.
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **_: real(include_defaults=False, include_path=tmp_path))
    assert "hex_rgb_choice" in task_manager(["hex_rgb_choice"]).task_index
    with pytest.raises(UserError, match=r"hex_rgb_choise: not a task.*did you mean hex_rgb_choice"):
        task_manager(["hex_rgb_choise"])


def test_without_the_extra_the_command_names_it(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    result = tuneforge_here("eval", str(tmp_path), "--tasks", "hellaswag")
    assert result.returncode == 2
    assert "pip install 'tuneforge[eval]'" in result.stderr


def test_results_go_to_the_runs_work_dir_or_to_out(tmp_path):
    from tuneforge.lm_eval_run import run_directory

    work_dir = tmp_path / "run"
    (work_dir / "checkpoints" / "final").mkdir(parents=True)
    (work_dir / "checkpoints" / "step-20").mkdir()
    (work_dir / "config.yaml").write_text("model: {}\n")
    assert run_directory(work_dir) == (work_dir / "checkpoints" / "final", work_dir)
    assert run_directory(work_dir / "checkpoints" / "step-20") == (work_dir / "checkpoints" / "step-20", work_dir)
    assert run_directory(tmp_path / "merged") == (tmp_path / "merged", None)
    (work_dir / "checkpoints" / "final").rmdir()
    with pytest.raises(UserError, match=r"no final checkpoint \(it has step-20\)"):
        run_directory(work_dir)
    (tmp_path / "merged").mkdir()
    result = tuneforge_here("eval", str(tmp_path / "merged"), "--tasks", "hellaswag")
    assert result.returncode == 2 and "pass --out FILE" in result.stderr


def test_a_task_the_harness_cannot_build_is_refused_before_the_model_loads(tmp_path, offline, monkeypatch):
    import tuneforge.export  # before the patch: it binds the real load_trained by name
    import tuneforge.trained

    checkpoint = adapter_checkpoint(tmp_path, trained=True)
    monkeypatch.setattr(tuneforge.trained, "load_trained", lambda *a, **k: pytest.fail("the model was loaded"))
    missing = tmp_path / "missing.yaml"
    missing.write_text(CHOICE_TASK.format(data=tmp_path / "gone.jsonl"), encoding="utf-8")
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: broken\noutput_type: nonsense\n", encoding="utf-8")
    for task, said in ((missing, "FileNotFoundError: Unable to find"), (broken, "invalid output_type 'nonsense'")):
        result = tuneforge_here("eval", str(checkpoint), "--tasks", str(task), "--out", str(tmp_path / "out.json"))
        assert result.returncode == 2 and "error: lm-evaluation-harness: " in result.stderr and said in result.stderr


def test_prompts_are_rendered_in_the_training_template(offline):
    """What the harness feeds the model for a task's prompt is what training put before the answer."""
    from tuneforge.data.conversation import prompt_conversation
    from tuneforge.data.templates import recorded_template
    from tuneforge.export import attach_chat_template
    from tuneforge.lm_eval_run import harness_model

    tokenizer = demo_tokenizer()
    attach_chat_template(tokenizer, {"template": DEMO_TEMPLATE})
    lm = harness_model(tiny_llama(tokenizer), tokenizer, batch_size=1)
    template = recorded_template(DEMO_TEMPLATE, Path("tuneforge.json"))
    trained = template.render(prompt_conversation([], "#ff8800"), tokenizer, None)
    assert lm.apply_chat_template([{"role": "user", "content": "#ff8800"}]) == trained == "<s>#ff8800\n"
    assert lm.tok_encode(trained) == template.prompt_ids(prompt_conversation([], "#ff8800"), tokenizer, None)


def test_an_adapter_that_changes_no_logit_is_refused(tmp_path, offline):
    from tuneforge.lm_eval_run import run_eval

    checkpoint = adapter_checkpoint(tmp_path, trained=False)
    task = write_task(tmp_path, CHOICE_TASK, "hex")
    with pytest.raises(UserError, match="the adapter changes no logit"):
        run_eval(checkpoint, str(task), limit=4, out=tmp_path / "out.json", device="cpu")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.trivial_process("lm-evaluation-harness records `git describe` and torch's collect_env in its results")
def test_an_adapter_is_scored_applied_and_its_base_with_it_disabled(tmp_path, offline):
    """The trained score is the adapter's (PEFT's own loading scores the same), the base score is the bare base
    model's, and the file holds the harness's layout with the base beside it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tuneforge.export import attach_chat_template
    from tuneforge.lm_eval_run import Model, Scoring, score, task_manager

    checkpoint = adapter_checkpoint(tmp_path, trained=True)
    task = write_task(tmp_path, CHOICE_TASK, "hex")
    out = tmp_path / "out.json"
    argv = ["eval", str(checkpoint), "--tasks", str(task), "--limit", "12", "--device", "cpu", "--out", str(out)]
    result = tuneforge_here(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "chat template: the run's (inline), applied to every prompt as in training" in result.stdout
    assert "adapter: applied in process; it changes the logits by up to" in result.stdout
    assert "scoring the base: " in result.stdout and "the adapters disabled" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("task"))
    assert header.split() == ["task", "metric", "base", "trained", "change"]
    written = json.loads(out.read_text())
    assert {"results", "configs", "versions", "n-samples", "base", "tuneforge"} <= written.keys()
    assert written["tuneforge"]["adapter_check"]["max_logit_change"] > 0
    assert written["n-samples"]["hex_rgb_choice"]["effective"] == 12

    tokenizer = demo_tokenizer()
    attach_chat_template(tokenizer, {"template": DEMO_TEMPLATE})
    scoring = Scoring([str(task)], 12, 16, True, task_manager([str(task)]))
    bare = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    bare_result = score(Model(bare, tokenizer), scoring)
    applied = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), checkpoint).eval()
    applied_result = score(Model(applied, tokenizer), scoring)
    for scored, by_hand in ((written["base"], bare_result), (written, applied_result)):
        for key in ("acc,none", "acc_norm,none"):
            assert scored["results"]["hex_rgb_choice"].get(key) == by_hand["results"]["hex_rgb_choice"].get(key)


@pytest.mark.trivial_process("lm-evaluation-harness records `git describe` and torch's collect_env in its results")
def test_a_base_model_without_a_recorded_template_is_scored_on_the_tasks_own_prompts(tmp_path, offline):
    tokenizer = demo_tokenizer()
    tiny_llama(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    task, out = write_task(tmp_path, CHOICE_TASK, "hex"), tmp_path / "out.json"
    result = tuneforge_here("eval", str(tmp_path / "model"), "--tasks", str(task), "--limit", "4", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "chat template: none recorded (no tuneforge.json); prompts as the tasks write them" in result.stdout
    assert "base: none to compare with" in result.stdout
    assert next(line for line in result.stdout.splitlines() if line.startswith("task")).split()[2] == "score"
    written = json.loads(out.read_text())
    assert written["base"] is None and written["results"]["hex_rgb_choice"]["alias"] == "hex_rgb_choice"


def test_eval_lm_eval_in_a_config_is_checked_before_training(tmp_path, monkeypatch):
    """Its local task files are made absolute for the resolved config, a missing one stops the run before
    anything loads, and the final checkpoint is scored by `tuneforge eval` with the settings given."""
    from tuneforge.config import load_config
    from tuneforge.config.load import describe_fields
    from tuneforge.lm_eval_tasks import check_settings, eval_command

    task = write_task(tmp_path, CHOICE_TASK, "hex")
    monkeypatch.chdir(tmp_path)
    config = load_config(REPO / "configs" / "demo.yaml", ["eval.lm_eval={tasks: [hex.yaml, arc_easy], limit: 40}"])
    assert check_settings(config.eval.lm_eval) == [str(task), "arc_easy"]
    assert config.eval.lm_eval.batch_size == 16 and config.eval.lm_eval.base is True
    assert eval_command(config.eval.lm_eval, tmp_path / "run", "cuda:0")[1:] == [
        *("-m", "tuneforge", "eval", str(tmp_path / "run"), "--tasks", "hex.yaml,arc_easy"),
        *("--batch-size", "16", "--device", "cuda:0", "--dtype", "fp32", "--limit", "40"),
    ]
    with pytest.raises(UserError, match=r"eval\.lm_eval\.tasks"):
        load_config(REPO / "configs" / "demo.yaml", ["eval.lm_eval={tasks: []}"])
    assert any(line.strip().startswith("eval.lm_eval.tasks (required)") for line in describe_fields())
    result = train_here(REPO / "configs" / "demo.yaml", tmp_path / "run", "eval.lm_eval={tasks: [gone.yaml]}")
    assert result.returncode == 2 and "--tasks: gone.yaml: no such task file" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_table_sets_base_and_trained_side_by_side():
    from tuneforge.lm_eval_run import side_by_side

    trained = {"results": {"hex": {"alias": "hex", "acc,none": 0.9, "acc_stderr,none": 0.03, "ppl,none": 2.5e9}}}
    base = {"results": {"hex": {"alias": "hex", "acc,none": 0.375, "acc_stderr,none": 0.05, "ppl,none": 7e30}}}
    lines = side_by_side(trained, base)
    assert lines[0].split() == ["task", "metric", "base", "trained", "change"]
    assert lines[1].split() == ["hex", "acc", "0.3750", "±", "0.0500", "0.9000", "±", "0.0300", "+0.5250"]
    assert lines[2].split() == ["hex", "ppl", "7e+30", "2.5e+09", "-7e+30"]
    assert side_by_side(trained, None)[0].split() == ["task", "metric", "score"]


DEMO_OVERRIDES = [
    "train.max_steps=100",
    "train.warmup_steps=5",
    "train.precision=fp32",
    "checkpoint.every_steps=1000",
    "eval.sample_prompts=[]",
    "eval.exact_match=null",
    "log.plot=false",
]


@pytest.mark.slow
def test_the_demo_scores_higher_trained_and_as_the_harness_own_cli_scores_it(tmp_path, offline):
    """The demo trained briefly with `eval.lm_eval`: at the end the local task's score has risen from the fresh
    model the run started from to the final checkpoint, and `lm_eval run` on the merged export (the harness's own
    CLI and loader, the template read from the export's tokenizer) gives the same scores, as does `tuneforge
    eval` on that export."""
    choice, likelihood = write_task(tmp_path, CHOICE_TASK, "choice"), write_task(tmp_path, LIKELIHOOD_TASK, "ll")
    tasks = f"{choice},{likelihood}"
    work_dir = tmp_path / "run"
    settings = f"eval.lm_eval={{tasks: [{choice}, {likelihood}], limit: 40, batch_size: 40}}"
    overrides = [*DEMO_OVERRIDES, settings, f"data.cache_dir={tmp_path}"]
    trained = train_here(REPO / "configs" / "demo.yaml", work_dir, *overrides)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    print(trained.stdout[trained.stdout.index("eval.lm_eval: ") :])
    written = json.loads((work_dir / "eval" / "lm_eval.json").read_text())
    base_acc = written["base"]["results"]["hex_rgb_choice"]["acc,none"]
    trained_acc = written["results"]["hex_rgb_choice"]["acc,none"]
    assert trained_acc >= base_acc + 0.3, (base_acc, trained_acc)
    assert written["tuneforge"]["base"] == "a fresh llama initialised from the run's config (seed 0)"
    assert written["tuneforge"]["chat_template"].startswith("chat template: the run's (inline)")
    assert re.search(r"^hex_rgb_choice +acc +0\.\d{4} ± 0\.\d{4} +0\.\d{4} ± 0\.\d{4} +\+0\.", trained.stdout, re.M)

    merged = tmp_path / "merged"
    exported = tuneforge_here("export", str(work_dir / "checkpoints" / "final"), "--out", str(merged), "--merge")
    assert exported.returncode == 0, exported.stderr
    cli_out = tmp_path / "cli.json"
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--tasks", tasks, "--apply_chat_template"]
    command += ["--model_args", f"pretrained={merged},dtype=float32", "--device", "cpu", "--batch_size", "40"]
    harness = subprocess.run(
        [*command, "--limit", "40", "--output_path", str(cli_out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path)},
    )
    assert harness.returncode == 0, harness.stderr[-3000:]
    cli = json.loads(next(cli_out.parent.rglob("cli*.json")).read_text())
    # `tuneforge eval` on the merged export (a full model, its template in its tokenizer) scores the same too.
    ours = tuneforge_here(
        "eval", str(merged), "--tasks", tasks, "--limit", "40", "--batch-size", "40", "--no-base", "--device", "cpu",
        "--out", str(tmp_path / "merged.json"),
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    on_merged = json.loads((tmp_path / "merged.json").read_text())
    for task, metric in (("hex_rgb_choice", "acc,none"), ("hex_rgb_likelihood", "perplexity,none")):
        assert cli["results"][task][metric] == pytest.approx(written["results"][task][metric], rel=1e-6, abs=0)
        assert on_merged["results"][task][metric] == pytest.approx(written["results"][task][metric], rel=1e-6, abs=0)


def test_local_task_files_in_a_config_are_beside_it_like_its_data(tmp_path, monkeypatch):
    from tuneforge.config import load_config

    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text("task: mine\n")
    (tmp_path / "cfg.yaml").write_text(
        "model: {architecture: llama, tokenizer: bytes}\ndata: {train_files: [x.jsonl]}\n"
        "eval: {lm_eval: {tasks: [tasks/mine.yaml, hellaswag, elsewhere.yaml]}}\n"
    )
    monkeypatch.chdir(tmp_path.parent)  # not the config's folder
    tasks = load_config(tmp_path / "cfg.yaml").eval.lm_eval.tasks
    assert tasks == [str(tmp_path / "tasks" / "mine.yaml"), "hellaswag", "elsewhere.yaml"]


@pytest.mark.slow
def test_step_checkpoints_are_scored_on_two_ranks_as_tuneforge_eval_scores_them(tmp_path, offline):
    """`at_checkpoints`: after each step checkpoint both ranks wait (one small vote a second) while the first
    scores it in a process of its own; the result equals `tuneforge eval` on the same checkpoint afterwards."""
    from conftest import launch

    choice = write_task(tmp_path, CHOICE_TASK, "choice")
    settings = f"eval.lm_eval={{tasks: [{choice}], limit: 20, batch_size: 20, at_checkpoints: true, base: false}}"
    overrides = [*DEMO_OVERRIDES, "train.max_steps=10", "checkpoint.every_steps=5", "checkpoint.keep_last=null"]
    overrides += ["checkpoint.save_final=false", settings, f"data.cache_dir={tmp_path}"]
    work_dir = tmp_path / "run"
    trained = launch(REPO / "configs" / "demo.yaml", work_dir, *overrides, ranks=2, timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert re.search(r"eval\.lm_eval @ step 5: hex_rgb_choice: acc 0\.\d{4}", trained.stdout)
    assert "no final checkpoint to score" in trained.stdout
    for step in (5, 10):
        during = json.loads((work_dir / "eval" / f"lm_eval-step-{step}.json").read_text())
        assert (work_dir / "eval" / f"lm_eval-step-{step}.log").read_text()
        after = tmp_path / f"after-{step}.json"
        checkpoint = work_dir / "checkpoints" / f"step-{step}"
        scored = tuneforge_here(
            "eval", str(checkpoint), "--tasks", str(choice), "--limit", "20", "--no-base", "--out", str(after)
        )
        assert scored.returncode == 0, scored.stderr[-2000:]
        task = "hex_rgb_choice"
        assert during["results"][task]["acc,none"] == json.loads(after.read_text())["results"][task]["acc,none"]


@pytest.mark.slow
def test_a_checkpoint_scoring_past_its_time_is_ended_and_training_goes_on(tmp_path, offline):
    choice = write_task(tmp_path, CHOICE_TASK, "choice")
    settings = f"eval.lm_eval={{tasks: [{choice}], limit: 4, at_checkpoints: true, base: false, timeout_s: 1}}"
    overrides = [*DEMO_OVERRIDES, "train.max_steps=3", "checkpoint.every_steps=2", "checkpoint.save_final=false"]
    trained = train_here(REPO / "configs" / "demo.yaml", tmp_path / "run", *overrides, settings)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    said = "step 2 not scored: it ran past eval.lm_eval.timeout_s (1s)"
    assert said in trained.stdout, trained.stdout[-3000:]
    assert not (tmp_path / "run" / "eval" / "lm_eval-step-2.json").exists()
    assert len([r for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if r]) == 3


def test_scoring_at_checkpoints_needs_step_checkpoints():
    from tuneforge.config.schema import Config

    with pytest.raises(ValueError, match=r"checkpoint\.every_steps is 0"):
        Config.model_validate(
            {
                "model": {"architecture": "llama", "tokenizer": "bytes"},
                "data": {"train_files": ["x.jsonl"]},
                "checkpoint": {"every_steps": 0},
                "eval": {"lm_eval": {"tasks": ["t"], "at_checkpoints": True}},
            }
        )


@pytest.mark.slow
def test_a_scoring_ends_when_the_training_run_is_killed(tmp_path, offline):
    """No process left behind: the run SIGKILLed while a checkpoint is being scored, its scoring child goes too."""
    import signal
    import time

    from conftest import TUNEFORGE

    choice = write_task(tmp_path, CHOICE_TASK, "choice")
    settings = f"eval.lm_eval={{tasks: [{choice}], at_checkpoints: true, base: false, batch_size: 1}}"
    overrides = [*DEMO_OVERRIDES, "train.max_steps=4", "checkpoint.every_steps=2", settings]
    work_dir = tmp_path / "run"
    command = [TUNEFORGE, "train", str(REPO / "configs" / "demo.yaml"), "--work-dir", str(work_dir), *overrides]
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        children: list[int] = []
        while time.monotonic() < deadline and not children:
            time.sleep(0.2)
            children = [int(c) for c in Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()]
        assert children, "no scoring child started"
        time.sleep(1.0)  # the child is importing torch and the harness
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{children[0]}").exists():
            state = Path(f"/proc/{children[0]}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.1)
        alive = Path(f"/proc/{children[0]}").exists()
        assert not alive or Path(f"/proc/{children[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        run.kill()


@pytest.mark.slow
def test_a_stop_signal_during_a_scoring_stops_both_ranks_at_one_step(tmp_path, offline):
    """SIGTERM while the first rank's scoring runs: every rank leaves the wait on the same vote (one rank leaving
    alone would leave the other in a collective), the run stops with its step checkpoint, and no scoring is left."""
    import signal
    import time

    from conftest import TUNEFORGE, free_port

    choice = write_task(tmp_path, CHOICE_TASK, "choice")
    settings = f"eval.lm_eval={{tasks: [{choice}], at_checkpoints: true, base: false, batch_size: 1}}"
    overrides = [*DEMO_OVERRIDES, "train.max_steps=50", "checkpoint.every_steps=2", settings]
    work_dir = tmp_path / "run"
    command = [TUNEFORGE, "train", str(REPO / "configs" / "demo.yaml"), "--work-dir", str(work_dir), *overrides]
    command += ["--nproc-per-node", "2", "--master-port", str(free_port())]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = work_dir / "eval" / "lm_eval-step-2.log"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not log.exists():
        time.sleep(0.2)
    assert log.exists(), "the scoring of step 2 never started"
    time.sleep(1.0)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 143, out[-2000:] + err[-3000:]
    assert "step 2 not scored: a stop signal arrived" in out, out[-3000:]
    stopped = re.search(r"stopping after step (\d+): SIGTERM received by 2 of 2 rank\(s\)", out)
    assert stopped, out[-3000:]
    assert (work_dir / "checkpoints" / f"step-{stopped.group(1)}" / "model.safetensors").exists()
    assert not (work_dir / "eval" / "lm_eval-step-4.log").exists()  # none started once the stop was known
    scorers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(log.parent) in _cmdline(p)]
    assert not scorers


def _cmdline(process: Path) -> str:
    try:
        return (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
