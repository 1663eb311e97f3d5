"""Coming from xtuner: the seed's config read without running it, every setting mapped or listed, and the
original job's exact shape run to the end at CPU scale."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tuneforge.config.load import load_config
from tuneforge.errors import UserError
from tuneforge.xtuner.mapping import import_config, to_yaml

from conftest import REPO, TUNEFORGE, free_port, tuneforge_here

REPORT = REPO.parent / "shared" / "seed" / "xtuner_deepseek_v2_lite_qlora_zero3.py"
# The report's own config when ../shared is next to the checkout; else a config of the same job shape.
SEED = REPORT if REPORT.exists() else REPO / "tests" / "assets" / "xtuner_qlora_zero3.py"


def test_the_seed_config_maps_completely():
    result = import_config(SEED, "deepspeed_zero3_offload", 8)
    config = result.config
    assert config["model"]["path"] == "deepseek-ai/DeepSeek-V2-Lite-Chat" and config["model"]["trust_remote_code"]
    assert config["model"]["quantization"] == {
        "bits": 4,
        "quant_type": "nf4",
        "double_quant": True,
        "compute_dtype": "bfloat16",
    }
    # No target_modules: xtuner adapts every linear layer, routed experts included, with its dropout.
    assert config["model"]["lora"] == {"r": 64, "alpha": 16, "dropout": 0.1, "targets": "all-linear", "experts": True}
    assert config["train"]["gradient_checkpointing"] is True  # xtuner's default
    assert config["data"]["format"] == "openai" and config["data"]["template"] == "deepseek_coder"
    assert config["data"]["max_length"] == 2048 and config["data"]["packing"] is False
    train = config["train"]
    assert (train["micro_batch_size"], train["gradient_accumulation"], train["epochs"]) == (1, 16, 10)
    assert (train["lr"], train["betas"], train["weight_decay"], train["max_grad_norm"]) == (2e-4, [0.9, 0.999], 0, 1)
    assert train["warmup_ratio"] == pytest.approx(0.03) and train["schedule"] == "cosine"
    assert train["precision"] == "auto"  # AmpOptimWrapper: mixed precision where the hardware computes it
    assert config["parallel"] == {"engine": "deepspeed", "zero_stage": 3, "cpu_offload": "all"}
    # Iterations become optimizer steps: 500 / 16 and 100 / 16.
    assert config["checkpoint"] == {"every_steps": 31, "keep_last": 2}
    assert config["eval"]["sample_every_steps"] == 6 and len(config["eval"]["sample_prompts"]) == 2
    assert config["log"] == {"every_steps": 1}
    assert any("500 iterations / accumulative_counts 16 = 31.25 optimizer steps -> 31" in n for n in result.notes)
    # What differs from xtuner's own data processing on unusual records is said.
    assert any(n.startswith("dataset_map_fn openai_map_fn -> format openai, which differs") for n in result.notes)
    assert any(n.startswith("max_length: xtuner cuts a longer sample at max_length tokens") for n in result.notes)
    assert result.unmapped == []
    assert result.launch == "tuneforge train OUT.yaml --nproc-per-node 8"
    # The layout as launched is kept, and the faster sound one named (the doctor sizes both).
    assert any(n.startswith("QLoRA under --deepspeed deepspeed_zero3_offload: kept as launched") for n in result.notes)
    assert "QLoRA under" not in " ".join(import_config(SEED, "deepspeed_zero2", 8).notes)


def test_unmappable_settings_are_listed_with_their_lines(tmp_path):
    text = SEED.read_text().replace("dataset_map_fn=openai_map_fn", "dataset_map_fn=my_custom_map_fn")
    text = text.replace("import torch\n", "import torch\nfrom my_project.maps import my_custom_map_fn\n", 1)
    text = text.replace("use_varlen_attn = False\n", "use_varlen_attn = False\nsequence_parallel_size = 2\n", 1)
    text += "\ndef helper():\n    return 1\n"
    path = tmp_path / "cfg.py"
    path.write_text(text)
    result = import_config(path)
    reasons = {what: (line, why) for line, what, why in result.unmapped}
    line, why = reasons["dataset_map_fn = my_custom_map_fn"]
    assert "dataset_map_fn=my_custom_map_fn" in text.splitlines()[line - 1] and "convert the data" in why
    assert "sequence_parallel_size = 2" not in reasons
    assert result.config["parallel"]["sequence_parallel"] == 2
    assert any("sequence_parallel_size = 2 (line" in note for note in result.notes)
    assert any("FunctionDef statements are not read" in why for _, why in reasons.values())


def test_the_original_report_text_gets_a_located_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("max_length = 2048\ndata_files = [数据地址\n")
    with pytest.raises(UserError, match=r"broken.py:2: not valid Python .*quoted path"):
        import_config(path)


def test_import_reads_only_config_files_and_never_writes_over_its_input(tmp_path, capsys):
    from tuneforge.cli import main

    assert main(["import-xtuner", "/dev/zero"]) == 2
    assert "error: /dev/zero: not a regular file" in capsys.readouterr().err
    source = tmp_path / "cfg.py"
    source.write_text(SEED.read_text())
    assert main(["import-xtuner", str(source), "-o", str(source)]) == 2
    assert "that is the xtuner config being imported" in capsys.readouterr().err
    assert source.read_text() == SEED.read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text("my notes\n")
    assert main(["import-xtuner", str(source), "-o", str(mine)]) == 2
    assert "exists and was not written by import-xtuner" in capsys.readouterr().err
    assert main(["import-xtuner", str(source), "-o", str(tmp_path / "out.yaml")]) == 0
    assert main(["import-xtuner", str(source), "-o", str(tmp_path / "out.yaml")]) == 0  # its own output: replaced


def test_an_unreadable_field_of_the_model_is_named_with_its_line(tmp_path):
    text = SEED.read_text()
    field = "pretrained_model_name_or_path=pretrained_model_name_or_path"
    start = text.index(field, text.index("model = dict("))
    line = text[:start].count("\n") + 1
    text = text[:start] + "pretrained_model_name_or_path=pick(1)" + text[start + len(field) :]
    path = tmp_path / "cfg.py"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        import_config(path)
    assert f"(field llm.pretrained_model_name_or_path (line {line}): positional arguments in a call)" in str(info.value)
    assert str(info.value).startswith(f"{path}:") and "no `model = dict(...)` found" not in str(info.value)


def test_a_config_that_grows_a_number_without_bound_is_read_in_bounded_time(tmp_path):
    """Squaring an integer 40 times would need 2**40 bits; each step past the bound is skipped and reported."""
    import time

    squares = "x = 3\n" + "x = x * x\n" * 40 + "s = 'ab'\n" + "s = s + s\n" * 30
    path = tmp_path / "cfg.py"
    path.write_text(SEED.read_text() + squares)
    started = time.monotonic()
    result = import_config(path)
    assert time.monotonic() - started < 10
    reasons = [why for _, what, why in result.unmapped if what == "statement"]
    assert sum("a number of more than 4096 bits" in why for why in reasons) == 40 - 11  # 3**(2**11) > 2**4096
    assert sum("a sequence too large to build" in why for why in reasons) == 30 - 18  # 2**20 > 10**6


# An xtuner 0.1.x gallery-style Alpaca config: its system prompt and template are reached through xtuner's
# own `SYSTEM_TEMPLATE` / `PROMPT_TEMPLATE`, and its sampler through a conditional, as in the gallery.
ALPACA_CONFIG = """\
import torch
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from torch.optim import AdamW
from transformers import AutoModelForCausalLM, AutoTokenizer
from xtuner.dataset import process_hf_dataset
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.map_fns import alpaca_map_fn, template_map_fn_factory
from xtuner.engine.hooks import EvaluateChatHook
from xtuner.engine.runner import TrainLoop
from xtuner.model import SupervisedFinetune
from xtuner.parallel.sequence import SequenceParallelSampler
from xtuner.utils import PROMPT_TEMPLATE, SYSTEM_TEMPLATE

pretrained_model_name_or_path = 'internlm/internlm2-chat-1_8b'
data_files = ['data/alpaca.jsonl']
prompt_template = PROMPT_TEMPLATE.made_up_chat
max_length = 1024
sequence_parallel_size = 1
batch_size = 2
accumulative_counts = 4
max_epochs = 1
lr = 2e-4
warmup_ratio = 0.03
SYSTEM = SYSTEM_TEMPLATE.alpaca
evaluation_inputs = ['Name three primary colours.']

tokenizer = dict(
    type=AutoTokenizer.from_pretrained,
    pretrained_model_name_or_path=pretrained_model_name_or_path,
    trust_remote_code=True,
    padding_side='right')
model = dict(
    type=SupervisedFinetune,
    llm=dict(
        type=AutoModelForCausalLM.from_pretrained,
        pretrained_model_name_or_path=pretrained_model_name_or_path,
        trust_remote_code=True,
        torch_dtype=torch.bfloat16))
train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files=data_files),
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=alpaca_map_fn,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    pack_to_max_length=False)
sampler = SequenceParallelSampler if sequence_parallel_size > 1 else DefaultSampler
train_dataloader = dict(
    batch_size=batch_size,
    num_workers=0,
    dataset=train_dataset,
    sampler=dict(type=sampler, shuffle=True),
    collate_fn=dict(type=default_collate_fn))
optim_wrapper = dict(
    type=AmpOptimWrapper,
    optimizer=dict(type=AdamW, lr=lr, betas=(0.9, 0.999), weight_decay=0),
    clip_grad=dict(max_norm=1, error_if_nonfinite=False),
    accumulative_counts=accumulative_counts,
    loss_scale='dynamic',
    dtype='float16')
param_scheduler = [
    dict(type=LinearLR, start_factor=1e-5, by_epoch=True, begin=0, end=warmup_ratio * max_epochs,
         convert_to_iter_based=True),
    dict(type=CosineAnnealingLR, eta_min=0.0, by_epoch=True, begin=warmup_ratio * max_epochs, end=max_epochs,
         convert_to_iter_based=True),
]
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)
custom_hooks = [
    dict(type=EvaluateChatHook, tokenizer=tokenizer, every_n_iters=100, evaluation_inputs=evaluation_inputs,
         system=SYSTEM, prompt_template=prompt_template),
]
randomness = dict(seed=None, deterministic=False)
"""

# Made-up texts in xtuner's templates.py layout: only their shape is xtuner's.
MADE_UP_SYSTEM = "You are a test assistant made up for tuneforge.\n"
MADE_UP_TEMPLATES = f"""\
from mmengine.config import ConfigDict

PROMPT_TEMPLATE = ConfigDict(
    made_up_chat=dict(
        SYSTEM='<|sys|>{{system}}\\n',
        INSTRUCTION='<|usr|>{{input}}\\n<|bot|>',
        SUFFIX='<|end|>',
        SUFFIX_AS_EOS=True,
        SEP='\\n',
        STOP_WORDS=['<|end|>']),
)
SYSTEM_TEMPLATE = ConfigDict(alpaca={MADE_UP_SYSTEM!r})
"""


def test_xtuners_sharded_moe_implementation_is_explained_not_listed_as_unmapped(tmp_path):
    """`moe_implementation='shard'` (xtuner's DeepSeek-V2 full fine-tuning configs) regroups per-expert modules
    for ZeRO-3's gathers; transformers' stacked experts make it unnecessary, which the import says."""
    old = "        trust_remote_code=True,\n        torch_dtype=torch.bfloat16))"
    assert old in ALPACA_CONFIG
    sharded = old[:-2] + ",\n        moe_implementation='shard',\n        expert_in_one_shard=8))"
    text = ALPACA_CONFIG.replace(old, sharded)
    result = import_config(_config(tmp_path, text))
    assert not [what for _, what, _ in result.unmapped if "moe_implementation" in what or "expert_in_one" in what]
    (note,) = [n for n in result.notes if n.startswith("model.llm.moe_implementation = 'shard'")]
    assert "expert_in_one_shard = 8: not needed: transformers' stacked experts" in note
    result = import_config(_config(tmp_path, text.replace("'shard'", "'magic'")))
    assert "model.llm.moe_implementation = 'magic'" in [what for _, what, _ in result.unmapped]


def _config(tmp_path: Path, text: str = ALPACA_CONFIG) -> Path:
    path = tmp_path / "cfg.py"
    path.write_text(text, encoding="utf-8")
    return path


def test_xtuner_templates_are_read_from_its_installed_package_never_imported(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "xtuner" / "utils").mkdir(parents=True)
    # Importing the fake package would fail: the templates must be read, not run.
    (site / "xtuner" / "__init__.py").write_text("raise RuntimeError('xtuner was imported')\n")
    (site / "xtuner" / "utils" / "__init__.py").write_text("raise RuntimeError('xtuner.utils was imported')\n")
    (site / "xtuner" / "utils" / "templates.py").write_text(MADE_UP_TEMPLATES)
    monkeypatch.syspath_prepend(str(site))
    result = import_config(_config(tmp_path))
    assert "xtuner" not in sys.modules
    assert result.unmapped == []
    data = result.config["data"]
    # The chat hook's system prompt is the sample chats' own: alpaca_map_fn's training text has none.
    assert result.config["eval"]["sample_system"] == MADE_UP_SYSTEM and "system" not in data
    assert data["format"] == "alpaca"
    # What alpaca_map_fn does otherwise than the Alpaca reader is said, with the fix for its skipped records.
    assert any("records whose output is <nooutput> are trained (xtuner skips them" in note for note in result.notes)
    assert data["template"] == {
        "system": "<|sys|>{system}\n",
        "instruction": "<|usr|>{input}\n<|bot|>",
        "suffix": "<|end|>",
        "suffix_as_eos": True,
        "sep": "\n",
        "stop_words": ["<|end|>"],
    }
    assert result.config["train"]["micro_batch_size"] == 2  # the dataloader after the conditional sampler
    out = tmp_path / "imported.yaml"
    out.write_text(to_yaml(result, tmp_path / "cfg.py"))
    config = load_config(out)
    assert config.eval.sample_system == MADE_UP_SYSTEM and config.data.system is None
    assert config.data.template.suffix_as_eos


def test_without_xtuner_its_templates_are_not_mapped_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "xtuner").exists()])
    path = _config(tmp_path)
    result = import_config(path)
    lines = ALPACA_CONFIG.splitlines()
    reasons = {what: (line, why) for line, what, why in result.unmapped}
    line, why = reasons["EvaluateChatHook.system = xtuner.utils.SYSTEM_TEMPLATE.alpaca"]
    assert "system=SYSTEM" in lines[line - 1]
    assert "not installed here: pip install xtuner==0.1.23 --no-deps, or set eval.sample_system" in why
    line, why = reasons["prompt template xtuner.utils.PROMPT_TEMPLATE.made_up_chat"]
    assert "template=prompt_template" in lines[line - 1] and why.endswith("or set data.template")
    assert "sample_system" not in result.config["eval"] and "template" not in result.config["data"]
    assert "# NOT MAPPED (line" in to_yaml(result, path)  # and nothing unresolved reaches the YAML dumper


def test_data_files_given_as_a_call_is_not_mapped_at_its_line(tmp_path):
    text = ALPACA_CONFIG.replace(
        "from xtuner.utils import", "from my_project.data import list_shards\nfrom xtuner.utils import"
    ).replace("data_files = ['data/alpaca.jsonl']", "data_files = list_shards(root='data/alpaca')")
    text = text.replace("optimizer=dict(type=AdamW, lr=lr,", "optimizer=dict(type=AdamW, lr=list_shards,")
    path = _config(tmp_path, text)
    result = import_config(path)
    reasons = {what: (line, why) for line, what, why in result.unmapped}
    line, why = reasons["data_files = list_shards(root)"]
    assert "data_files=data_files" in text.splitlines()[line - 1] and "set data.train_files" in why
    assert "train_files" not in result.config["data"]
    # A symbol where a value belongs never reaches the YAML dumper either.
    line, why = reasons["config.train.lr = my_project.data.list_shards"]
    assert "lr=list_shards" in text.splitlines()[line - 1] and "lr" not in result.config["train"]
    to_yaml(result, path)
    # The `datasets` form dict(train=...) is the train split's files.
    text = ALPACA_CONFIG.replace("data_files = ['data/alpaca.jsonl']", "data_files = dict(train='data/a.jsonl')")
    result = import_config(_config(tmp_path, text))
    assert result.config["data"]["train_files"] == [str(Path("data/a.jsonl").resolve())]


def test_the_yaml_says_how_to_launch_it(tmp_path):
    result = import_config(SEED, "deepspeed_zero3_offload", 4)
    assert result.launch == "tuneforge train OUT.yaml --nproc-per-node 4"
    assert "# launch: tuneforge train OUT.yaml --nproc-per-node 4  (OUT.yaml: this file)\n" in to_yaml(result, SEED)
    out = tmp_path / "my.yaml"
    assert f"# launch: tuneforge train {out} --nproc-per-node 4\n" in to_yaml(result, SEED, out)


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"model = dict()\x00\x01\x02"])
def test_a_binary_file_gets_one_user_error(tmp_path, content):
    path = tmp_path / "weights.bin"
    path.write_bytes(content)
    with pytest.raises(UserError, match=r"weights.bin: (not a text file|contains NUL bytes)"):
        import_config(path)


DPO_CONFIG = (
    ALPACA_CONFIG.replace(
        "from xtuner.model import SupervisedFinetune",
        "from peft import LoraConfig\nfrom xtuner.dataset.preference_dataset import build_preference_dataset, "
        "orpo_dpo_mix_40k_map_fn\nfrom xtuner.model.dpo import DPO",
    )
    .replace(
        """model = dict(
    type=SupervisedFinetune,
    llm=dict(""",
        """model = dict(
    type=DPO,
    loss_type='hinge',
    use_varlen_attn=True,
    beta=0.2,
    label_smoothing=0.05,
    lora=dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.0, bias='none', task_type='CAUSAL_LM'),
    llm=dict(""",
    )
    .replace(
        """train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files=data_files),
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=alpaca_map_fn,
    template_map_fn=dict(type=template_map_fn_factory, template=prompt_template),
    pack_to_max_length=False)""",
        """train_dataset = dict(
    type=build_preference_dataset,
    dataset=dict(type=load_dataset, path='json', data_files=data_files),
    tokenizer=tokenizer,
    max_length=max_length,
    dataset_map_fn=orpo_dpo_mix_40k_map_fn,
    is_dpo=True,
    is_reward=False,
    reward_token_id=-1,
    num_proc=32,
    use_varlen_attn=True,
    max_packed_length=max_length * 2,
    shuffle_before_pack=True)""",
    )
)


def test_dpo_and_orpo_configs_import_with_their_loss_settings(tmp_path):
    result = import_config(_config(tmp_path, DPO_CONFIG))
    config = result.config
    assert config["train"]["objective"] == "dpo"
    assert config["preference"] == {"beta": 0.2, "loss_type": "hinge", "label_smoothing": 0.05}
    assert config["model"]["lora"] == {"r": 8, "alpha": 16, "dropout": 0.0, "targets": "all-linear", "experts": True}
    assert config["data"]["template"] == "tokenizer" and config["data"]["packing"] is True
    assert config["data"]["max_length"] == 1024 and config["data"]["train_files"][0].endswith("data/alpaca.jsonl")
    assert not [what for _, what, _ in result.unmapped if "dataset" in what or "DPO" in what], result.unmapped
    (tmp_path / "out.yaml").write_text(to_yaml(result, tmp_path / "cfg.py"))
    loaded = load_config(tmp_path / "out.yaml")
    assert loaded.train.objective == "dpo" and loaded.preference.loss_type == "hinge" and loaded.paired

    kto = import_config(_config(tmp_path, DPO_CONFIG.replace("loss_type='hinge'", "loss_type='kto_pair'")))
    assert any("kto_pair" in what for _, what, _ in kto.unmapped)
    full = import_config(_config(tmp_path, DPO_CONFIG.replace("    lora=dict(type=LoraConfig", "    # lora=dict(")))
    assert not [what for _, what, _ in full.unmapped if "lora" in what or "DPO" in what]
    assert "lora" not in full.config["model"]
    assert any("precomputed once, before training" in note for note in full.notes)
    orpo = import_config(
        _config(
            tmp_path,
            DPO_CONFIG.replace("type=DPO,", "type=ORPO,")
            .replace("from xtuner.model.dpo import DPO", "from xtuner.model.orpo import ORPO")
            .replace("    loss_type='hinge',\n", "")
            .replace("    label_smoothing=0.05,\n", ""),
        )
    )
    assert orpo.config["train"]["objective"] == "orpo" and orpo.config["preference"] == {"lambda": 0.2}


def test_reward_model_configs_import_with_their_loss_and_penalty(tmp_path):
    text = DPO_CONFIG.replace("from xtuner.model.dpo import DPO", "from xtuner.model.reward import RewardModel")
    text = text.replace(
        "    beta=0.2,\n    label_smoothing=0.05,\n", "    penalty_type='L2',\n    penalty_weight=0.05,\n"
    )
    text = text.replace("loss_type='hinge'", "loss_type='focal'").replace("type=DPO,", "type=RewardModel,")
    text = text.replace(
        "is_dpo=True,\n    is_reward=False,\n    reward_token_id=-1,",
        "is_dpo=False,\n    is_reward=True,\n    reward_token_id=92527,",
    )
    result = import_config(_config(tmp_path, text))
    assert result.config["train"]["objective"] == "reward"
    assert result.config["preference"] == {"reward_loss": "focal", "penalty": "l2", "penalty_weight": 0.05}
    assert not result.unmapped, result.unmapped
    assert any("reward_token_id = 92527" in note and "no token is added" in note for note in result.notes)
    # The chat hook's prompts would have a reward model generate: left out, said why.
    assert "sample_prompts" not in result.config.get("eval", {})
    assert any(note.startswith("EvaluateChatHook (line ") for note in result.notes)
    (tmp_path / "out.yaml").write_text(to_yaml(result, tmp_path / "cfg.py"))
    loaded = load_config(tmp_path / "out.yaml")
    assert loaded.train.objective == "reward" and loaded.paired and loaded.preference.penalty == "l2"


# The original job's shape at CPU scale: the same architecture with tiny sizes (every quantized layer's output a
# multiple of 32 for bitsandbytes' CPU kernels), a larger init range so adapters move the loss within a few steps.
TINY_DEEPSEEK_V2 = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=24,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    initializer_range=0.2,
)


@pytest.fixture(scope="module")
def original_job(tmp_path_factory) -> Path:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tuneforge.data.byte_tokenizer import build_byte_tokenizer

    root = tmp_path_factory.mktemp("original")
    tokenizer = build_byte_tokenizer()
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_DEEPSEEK_V2,
    )
    DeepseekV2ForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    records = []
    for i in range(48):
        colour = f"#{(i * 5) % 256:02x}{(i * 11) % 256:02x}{(i * 17) % 256:02x}"
        rgb = f"({(i * 5) % 256}, {(i * 11) % 256}, {(i * 17) % 256})"
        records.append(
            {
                "messages": [
                    {"role": "system", "content": "You convert colours."},
                    {"role": "user", "content": "Say hi."},
                    # Context only: as a JSON boolean in half the records and as a string in the others.
                    {"role": "assistant", "content": "hi", "loss": False if i % 2 else "false"},
                    {"role": "user", "content": f"Convert {colour} to RGB."},
                    {"role": "assistant", "content": rgb, "loss": True if i % 2 else "true"},
                ]
            }
        )
    (root / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return root


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,extra",
    # The report's job with packing on, which exercises the most (unpacked rows and FSDP2 are covered by the
    # 2-ranks-equal-1 matrix); one variant keeps the CI under its 30 minutes.
    [("zero3_offload_packed", ["data.packing=true"])],
)
def test_the_original_job_runs_to_the_end_at_cpu_scale(original_job, variant, extra):
    work = original_job / variant
    command = [
        TUNEFORGE, "train", str(SEED), "--deepspeed", "deepspeed_zero3_offload",
        "--work-dir", str(work), "--nproc-per-node", "2", "--master-port", str(free_port()),
        f"model.path={original_job / 'model'}", f"data.train_files=[{original_job / 'train.jsonl'}]",
        "data.max_length=512", "train.max_steps=5", "train.lr=5e-3", "checkpoint.every_steps=1",
        "eval.sample_every_steps=2", "eval.sample_max_new_tokens=8", *extra,
        # The report's accumulation of 16 micro-batches made each step here take 4-8 s: 4 run the same code.
        "train.gradient_accumulation=4",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "quantization: base weights 4-bit nf4, double quant" in out and "lora: r=64 alpha=16 dropout=0.1," in out
    assert "routed-expert weights left out" not in out  # adapters on the experts too, as xtuner put them
    assert re.search(r"; the stacked experts of \d+ MoE block\(s\) too", out)  # 4-bit experts, as QLoRA means
    assert "transformers implements deepseek_v2 natively" in out  # trust_remote_code asked, native used
    assert "deepseek_coder renders a conversation differently" not in out  # the byte tokenizer has no template
    assert "engine: " + ("fsdp" if variant == "fsdp" else "deepspeed") in out
    checkpoints = sorted(p.name for p in (work / "checkpoints").iterdir())
    assert checkpoints == ["final", "step-4", "step-5"]  # save_total_limit 2
    samples = [json.loads(line) for line in (work / "samples.jsonl").open()]
    assert {s["step"] for s in samples} == {2, 4, 5} and len(samples) == 6
    losses = [json.loads(line)["loss"] for line in (work / "metrics.jsonl").open()]
    assert len(losses) == 5 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_xtuners_mixed_precision_imports_as_auto_never_as_bf16_a_cpu_would_emulate(tmp_path, dtype):
    text = SEED.read_text()
    wrapper = text.index("type=AmpOptimWrapper")
    start = text.index("float16", wrapper)  # the wrapper's dtype
    source = tmp_path / "cfg.py"
    source.write_text(text[:start] + dtype + text[start + len("float16") :])
    out = tmp_path / "out.yaml"
    result = tuneforge_here("import-xtuner", str(source), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert load_config(out).train.precision == "auto"
    (note,) = [line for line in result.stdout.splitlines() if "AmpOptimWrapper" in line]
    assert f"AmpOptimWrapper dtype {dtype}" in note and "-> train.precision auto: bf16 where the hardware" in note
    assert ("train.precision=fp16" in note) == (dtype == "float16")  # xtuner's fp16 stays one setting away
