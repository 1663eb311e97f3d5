"""Files someone hands over never run code: checkpoints resumed, adapters chatted with or exported."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tuneforge.checkpoint_records import MANIFEST
from tuneforge.engines.deepspeed import _deepspeed_record_type
from tuneforge.engines.fsdp import _dcp_metadata_type
from tuneforge.errors import UserError
from tuneforge.pickle_guard import UNRESOLVED, pickle_globals, refuse_unsafe_pickles
from tuneforge.train.state import load_rng

from conftest import TINY_LLAMA, TUNEFORGE, chat, train_here, tuneforge_here, write_jsonl


class RunsACommand:
    """What a hostile file holds: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_scan_finds_the_call_at_every_pickle_protocol(tmp_path, protocol):
    data = pickle.dumps({"state": [1, 2.0, "x"], "payload": RunsACommand(tmp_path / "ran")}, protocol=protocol)
    assert "posix.system" in pickle_globals(data) or "os.system" in pickle_globals(data)
    assert not (tmp_path / "ran").exists()


def test_a_global_named_through_the_memo_or_built_at_load_time_is_found():
    import pickletools

    # STACK_GLOBAL whose strings come back from the memo (as pickle writes a repeated name).
    memo_named = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94h\x00h\x01\x93\x94."
    assert pickle_globals(pickletools.optimize(memo_named)) == {"os.system"}
    assert pickle_globals(memo_named) == {"os.system"}
    # STACK_GLOBAL over strings built at load time (a call's result): cannot be named, so never allowed.
    built = b"\x80\x04\x8c\x08builtins\x8c\x03str\x93\x8c\x02os\x85R\x8c\x06system\x93."
    assert UNRESOLVED in pickle_globals(built)


def write_tiny_run(directory) -> None:
    write_jsonl(directory / "train.jsonl", [chat(f"question {i}", f"answer {i}") for i in range(8)])
    (directory / "cfg.yaml").write_text(
        TINY_LLAMA
        + "data: {train_files: [train.jsonl], cache_dir: null}\n"
        + "train: {lr: 1.0e-3, micro_batch_size: 2, gradient_accumulation: 1, max_steps: 3, precision: fp32}\n"
        + "checkpoint: {every_steps: 2, save_final: false}\nlog: {progress: lines}\n"
    )


@pytest.mark.slow
def test_a_checkpoint_whose_rng_file_runs_code_is_refused_without_running_it(tmp_path):
    """The hostile form of an older tuneforge's RNG file (a pickle), with the manifest made to match: resume
    says why it refuses, and the command in it never runs."""
    write_tiny_run(tmp_path)
    assert train_here(tmp_path / "cfg.yaml", tmp_path / "run").returncode == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-2"
    state = checkpoint / "training_state"
    (state / "rng-rank-0.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({"torch": torch.get_rng_state(), "payload": RunsACommand(marker)}, state / "rng-rank-0.pt")
    manifest = {
        path.relative_to(checkpoint).as_posix(): path.stat().st_size
        for path in checkpoint.rglob("*")
        if path.is_file() and path.name != MANIFEST
    }
    (checkpoint / MANIFEST).write_text(json.dumps({"files": manifest}))

    resumed = train_here(tmp_path / "cfg.yaml", tmp_path / "run", "--resume", str(checkpoint))
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    assert f"--resume: {state / 'rng-rank-0.pt'} holds more than random-generator states" in resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert not marker.exists()


def test_an_older_tuneforge_rng_file_still_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # a cached Gaussian in numpy's state
    legacy = {
        "torch": torch.get_rng_state(),
        "cuda": None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    torch.save(legacy, tmp_path / "rng-rank-0.pt")  # how tuneforge wrote it before
    expected = (random.random(), np.random.randn(), torch.rand(2).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_rng(tmp_path, 0)
    assert (random.random(), np.random.randn(), torch.rand(2).tolist()) == expected


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_checkpoint_metadata_is_refused_when_it_would_run_code(tmp_path):
    """A real `.metadata` written by PyTorch passes the FSDP engine's scan; the same file made hostile is refused
    before PyTorch's pickle.load could run it."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"weight": torch.randn(4, 3)}, "optimizer": {"step": torch.tensor(2.0)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "fsdp"))
    metadata = tmp_path / "fsdp" / ".metadata"
    refuse_unsafe_pickles([metadata], _dcp_metadata_type, "--resume x", single_pickle=True)  # PyTorch's: accepted

    marker = tmp_path / "ran"
    metadata.write_bytes(pickle.dumps([pickle.loads(metadata.read_bytes()), RunsACommand(marker)]))
    with pytest.raises(UserError, match=r"--resume x: .*\.metadata would import (posix|os)\.system when loaded"):
        refuse_unsafe_pickles([metadata], _dcp_metadata_type, "--resume x", single_pickle=True)
    assert not marker.exists()


def test_deepspeed_state_files_pass_and_hostile_ones_are_refused(tmp_path):
    """What DeepSpeed pickles into its optimizer state files (its loss scaler, the ZeRO stage enum, tensors)
    passes the DeepSpeed engine's scan; a file that calls anything else is refused."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    record = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.weights, "m": torch.ones(3)}
    torch.save(record, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    refuse_unsafe_pickles([tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"], _deepspeed_record_type, "r")

    torch.save({**record, "x": RunsACommand(tmp_path / "ran")}, tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(UserError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt:.*data\.pkl would import"):
        refuse_unsafe_pickles(sorted(tmp_path.glob("*.pt")), _deepspeed_record_type, "r")


def code_running_model(directory, marker) -> None:
    """A model directory whose architecture transformers lacks: its config names Python files, which touch
    `marker` when imported."""
    directory.mkdir()
    (directory / "evil_config.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig\n\n\nclass EvilConfig(PretrainedConfig):\n"
        "    model_type = 'evil'\n"
    )
    config = {"model_type": "evil", "auto_map": {"AutoConfig": "evil_config.EvilConfig"}, "architectures": ["E"]}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.slow
def test_an_adapter_that_asks_for_remote_code_does_not_get_it(tmp_path, tokenizer):
    """An adapter whose tuneforge.json says its base trained with trust_remote_code, on a base with Python files:
    chat and export refuse, naming --trust-remote-code, and nothing from the base directory runs."""
    marker = tmp_path / "ran"
    code_running_model(tmp_path / "base", marker)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    tokenizer.save_pretrained(adapter)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 4)}, adapter / "adapter_model.safetensors")
    peft_config = {"peft_type": "LORA", "base_model_name_or_path": str(tmp_path / "base"), "r": 2}
    (adapter / "adapter_config.json").write_text(json.dumps(peft_config))
    meta = {"template": "chatml", "system": None, "adapter": {"dtype": "fp32", "trust_remote_code": True}}
    (adapter / "tuneforge.json").write_text(json.dumps(meta))

    for command in (["chat", str(adapter), "--prompt", "hi"], ["export", str(adapter), "--out", str(tmp_path / "o")]):
        result = subprocess.run([TUNEFORGE, *command], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "transformers does not implement this model's architecture" in result.stderr, result.stderr[-2000:]
        assert "(it was trained with model.trust_remote_code: true)" in result.stderr
        assert "pass --trust-remote-code" in result.stderr and "Traceback" not in result.stderr
        assert not marker.exists()


@pytest.mark.slow
def test_a_full_checkpoint_with_custom_code_needs_the_flag(tmp_path, tokenizer):
    marker = tmp_path / "ran"
    code_running_model(tmp_path / "model", marker)
    tokenizer.save_pretrained(tmp_path / "model")
    save_file({"w": torch.zeros(1)}, tmp_path / "model" / "model.safetensors")
    result = subprocess.run(
        [TUNEFORGE, "chat", str(tmp_path / "model"), "--prompt", "hi"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "If you trust them, pass --trust-remote-code" in result.stderr, result.stderr
    assert "(it was trained with" not in result.stderr and not marker.exists()


def test_a_checkpoint_in_pytorch_format_loads_when_it_holds_data_and_is_refused_when_it_would_run_code(
    tmp_path, tokenizer
):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tuneforge.trained import load_trained

    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    )
    model.config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = load_trained(tmp_path).model
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)

    torch.save({**model.state_dict(), "x": RunsACommand(tmp_path / "ran")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"pytorch_model\.bin:.*data\.pkl would import (posix|os)\.system when"):
        load_trained(tmp_path)
    assert not (tmp_path / "ran").exists()


def tiny_checkpoint(directory, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "tuneforge.json").write_text(json.dumps({"template": "qwen_chat", "system": None}))
    return directory


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("meta-json", "tuneforge.json: not readable (Expecting"),
        ("meta-types", "tuneforge.json: template is ['x'], not str or dict"),
        ("meta-template", "tuneforge.json: the recorded template is not readable"),
        ("tokenizer", ": the tokenizer cannot be loaded ("),
        ("config", ": the model cannot be loaded ("),
    ],
)
def test_a_received_checkpoint_with_broken_files_gets_one_line(tmp_path, tokenizer, capsys, damage, expected):
    from tuneforge.cli import main

    checkpoint = tiny_checkpoint(tmp_path / "ckpt", tokenizer)
    capsys.readouterr()  # the save's progress bar
    meta = checkpoint / "tuneforge.json"
    if damage == "meta-json":
        meta.write_text('{"template": "qwen_chat"\n"system": 1}')
    elif damage == "meta-types":
        meta.write_text(json.dumps({"template": ["x"]}))
    elif damage == "meta-template":
        meta.write_text(json.dumps({"template": {"instruction": 5, "colour": "red"}}))
    elif damage == "tokenizer":
        (checkpoint / "tokenizer.json").write_text('{"version": "1.0"}')
    else:
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "vocab_size": 4 * config["vocab_size"]}))
    assert main(["chat", str(checkpoint), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(tmp_path, tokenizer, capsys):
    from tuneforge.cli import main

    checkpoint = tiny_checkpoint(tmp_path / "ckpt", tokenizer)
    capsys.readouterr()
    assert main(["chat", str(checkpoint), "--prompt", "caf\udce9"]) == 2  # how Python keeps a raw byte from argv
    assert capsys.readouterr().err == "error: --prompt: not UTF-8 text; give the prompt in UTF-8\n"


def test_only_exact_data_names_pass_the_scan():
    """From protocol 4 a dotted name is followed attribute by attribute: a name under an allowed prefix can
    reach a loader method that writes or runs files."""
    from tuneforge.pickle_guard import data_global

    assert (
        data_global("numpy.dtypes.UInt32DType") and data_global("torch.float32") and data_global("torch.FloatStorage")
    )
    for name in ("numpy.dtypes.__loader__.set_data", "torch.__loader__", "torch.os.system", "torch.load"):
        assert not data_global(name), name
    assert not _dcp_metadata_type("torch.distributed.checkpoint.metadata.os")


def test_files_are_read_as_torch_reads_them(tmp_path):
    """A pickle with a zip appended is a pickle to torch (it checks the first bytes), a zip naming a member
    twice hides the first from a reader, and the legacy format holds several pickles: none passes."""
    import zipfile

    payload = pickle.dumps(RunsACommand(tmp_path / "ran"))
    disguised = tmp_path / "disguised.pt"
    torch.save({"w": torch.ones(1)}, tmp_path / "real.pt")
    disguised.write_bytes(payload + (tmp_path / "real.pt").read_bytes())
    twice = tmp_path / "twice.pt"
    with zipfile.ZipFile(twice, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
        with pytest.warns(UserWarning):
            archive.writestr("archive/data.pkl", pickle.dumps({"w": 1}))
    for path, why in ((disguised, "not in PyTorch's zip format"), (twice, "names a member twice")):
        with pytest.raises(UserError, match=why):
            refuse_unsafe_pickles([path], _deepspeed_record_type, "r")
    assert not (tmp_path / "ran").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_distributed_checkpoint_value_that_would_run_code_is_refused_by_the_fsdp_planner(tmp_path):
    """PyTorch's own planner reads non-tensor values with weights_only=False; the FSDP engine's reads each with
    the weights-only loader first."""
    import torch.distributed.checkpoint as dcp

    from tuneforge.engines.fsdp import DataOnlyLoadPlanner, load_data_only

    dcp.save({"w": torch.ones(2), "settings": {"lr": 0.1, "betas": (0.9, 0.99)}}, checkpoint_id=str(tmp_path / "ok"))
    state = {"w": torch.zeros(2), "settings": {"lr": 0.0, "betas": (0.0, 0.0)}}
    dcp.load(state, checkpoint_id=str(tmp_path / "ok"), planner=DataOnlyLoadPlanner())
    assert state["settings"] == {"lr": 0.1, "betas": (0.9, 0.99)} and torch.equal(state["w"], torch.ones(2))

    hostile = {"w": torch.ones(2), "settings": {"lr": RunsACommand(tmp_path / "ran"), "betas": (0.9, 0.99)}}
    dcp.save(hostile, checkpoint_id=str(tmp_path / "bad"))
    with pytest.raises(UserError, match=r"a value of the FSDP checkpoint \(settings.lr\) holds more than data") as info:
        load_data_only(state, tmp_path / "bad")
    assert not (tmp_path / "ran").exists()
    assert "weights_only" not in str(info.value)  # torch's advice, to load it unsafely, is never quoted
    assert str(info.value).endswith("tuneforge does not load files that could run code: take another checkpoint")


@pytest.mark.slow
def test_exporting_an_adapter_never_runs_the_tokenizer_code_it_names(tmp_path, tokenizer):
    """An adapter handed over with a tokenizer_config.json whose only tokenizer class is an auto_map entry naming a
    Python file beside it: transformers asked the user whether to run it, and a "y" ran it. Export refuses the
    tokenizer instead, with one message, and nothing runs whatever the user types."""
    from peft import LoraConfig, get_peft_model

    from conftest import tiny_llama

    marker = tmp_path / "ran"
    base = tiny_llama(tokenizer)
    base.save_pretrained(tmp_path / "base")
    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    (adapter / "tokenization_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    settings = json.loads((adapter / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class", None)
    settings["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}
    (adapter / "tokenizer_config.json").write_text(json.dumps(settings))
    meta = {"template": "chatml", "system": None, "adapter": {"dtype": "fp32"}}
    (adapter / "tuneforge.json").write_text(json.dumps(meta))

    command = [TUNEFORGE, "export", str(adapter), "--out", str(tmp_path / "out"), "--base", str(tmp_path / "base")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, input="y\n")
    assert not marker.exists()
    assert result.returncode == 2 and f"{adapter}: the tokenizer cannot be loaded" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_training_on_a_model_folder_with_its_own_code_is_refused_in_one_line(tmp_path, tokenizer):
    """The folder's code never runs; train (with and without the doctor), doctor, chat and export each say why
    in one line."""
    marker = tmp_path / "ran"
    code_running_model(tmp_path / "model", marker)
    tokenizer.save_pretrained(tmp_path / "model")
    save_file({"w": torch.zeros(1)}, tmp_path / "model" / "model.safetensors")
    write_jsonl(tmp_path / "train.jsonl", [chat("question", "answer")])
    config = tmp_path / "cfg.yaml"
    config.write_text("model: {path: model}\ndata: {train_files: [train.jsonl], cache_dir: null}\n")
    refusal = (
        f"error: model.path: {tmp_path / 'model'} needs its own Python code (evil_config.py, named by auto_map in "
        "its config.json): transformers does not implement model_type 'evil'"
    )
    for command in (
        ["train", str(config), "--work-dir", str(tmp_path / "run")],
        ["train", str(config), "--work-dir", str(tmp_path / "run"), "watchdog.doctor='off'"],
        ["doctor", str(config)],
    ):
        result = tuneforge_here(*command)
        assert result.returncode == 2, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert errors == [result.stderr.strip().splitlines()[-1]] and errors[0].startswith(refusal), result.stderr
        assert "set model.trust_remote_code=true if you trust that code" in errors[0]
        assert "Traceback" not in result.stderr and not marker.exists()
    model = str(tmp_path / "model")
    for command in (["chat", model, "--prompt", "hi"], ["export", model, "--out", str(tmp_path / "out")]):
        result = tuneforge_here(*command)
        assert result.returncode == 2 and "pass --trust-remote-code" in result.stderr and not marker.exists()


def test_training_on_a_model_type_transformers_lacks_is_refused_in_one_line(tmp_path, tokenizer):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "nothing_known", "hidden_size": 8}))
    tokenizer.save_pretrained(tmp_path / "model")
    write_jsonl(tmp_path / "train.jsonl", [chat("question", "answer")])
    (tmp_path / "cfg.yaml").write_text("model: {path: model}\ndata: {train_files: [train.jsonl], cache_dir: null}\n")
    result = train_here(tmp_path / "cfg.yaml", tmp_path / "run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: model.path: {tmp_path / 'model'} has model_type 'nothing_known', which this transformers does not "
        "implement, and no code of its own (no auto_map in its config.json); use a model transformers implements"
    )
