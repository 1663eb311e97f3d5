"""Expert parallelism (DeepSpeed's AutoEP) through the real launcher on 2 gloo ranks: a tiny DeepseekV2 and a tiny
Qwen3-MoE with their 4 routed experts split 2 per rank train exactly as one process does, their checkpoints are
Hugging Face models, a killed run resumes to the uninterrupted result, and a rank missing from the token exchange
is diagnosed. Every AutoEP preset tuneforge accepts converts and writes back exactly. What cannot run is refused
before the model loads, with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tuneforge.config.schema import Config
from tuneforge.distributed import DistInfo
from tuneforge.engines import choose_engine
from tuneforge.engines.expert_parallel import expert_parallel_problems
from tuneforge.errors import UserError
from tuneforge.train.state import check_compatible, read_state

from conftest import TINY_MODELS, chat, launch, metrics, train_here, write_jsonl

CONFIG = f"""\
model: {TINY_MODELS["deepseek_v2"]}
data: {{train_files: [train.jsonl], cache_dir: null}}
train: {{lr: 3.0e-3, micro_batch_size: 2, gradient_accumulation: 2, max_steps: 4, precision: fp32, seed: 3}}
checkpoint: {{every_steps: 2, keep_last: 2}}
parallel: {{engine: deepspeed, zero_stage: 2, expert_parallel: 2}}
watchdog: {{startup_timeout_s: 120, stall_timeout_s: 8, report_grace_s: 3}}
log: {{progress: lines, plot: false}}
"""


def write_job(directory) -> None:
    write_jsonl(directory / "train.jsonl", [chat(f"question {i}", f"answer {i * 7}") for i in range(40)])
    (directory / "cfg.yaml").write_text(CONFIG)


def weights(checkpoint) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def expert_parallel_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ep")
    write_job(directory)
    result = launch(directory / "cfg.yaml", directory / "run", ranks=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, result


@pytest.mark.slow
def test_two_ranks_with_experts_split_between_them_train_as_one_process(expert_parallel_run, tmp_path):
    directory, result = expert_parallel_run
    assert "experts: 4 per layer over 2 ranks, 2 each (DeepSpeed AutoEP)" in result.stdout
    one = train_here(directory / "cfg.yaml", tmp_path / "one", "parallel.engine=single", "parallel.expert_parallel=1",
                     "train.micro_batch_size=4")  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    split, whole = metrics(directory / "run"), metrics(tmp_path / "one")
    for key in ("loss", "router_aux_loss", "grad_norm"):
        assert [r[key] for r in split] == pytest.approx([r[key] for r in whole], rel=1e-5, abs=1e-6), key
    # The checkpoint is the model's own layout: experts gathered from both ranks, the router under its name.
    final = directory / "run" / "checkpoints" / "final"
    assert_same_weights(weights(final), weights(tmp_path / "one" / "checkpoints" / "final"), 1e-5)


@pytest.mark.slow
def test_a_qwen3_moe_with_experts_split_between_two_ranks_trains_as_one_process(tmp_path):
    """Qwen3-MoE through AutoEP's preset (its router-logit recorder left out of the conversion): the same
    losses, router loss and gradient norms as one process, and a checkpoint `from_pretrained` reads with the
    same weights."""
    write_job(tmp_path)
    qwen = CONFIG.replace(TINY_MODELS["deepseek_v2"], TINY_MODELS["qwen3_moe"])
    (tmp_path / "cfg.yaml").write_text(qwen.replace("every_steps: 2", "every_steps: 0"))
    split = launch(tmp_path / "cfg.yaml", tmp_path / "split", ranks=2)
    assert split.returncode == 0, split.stderr[-3000:]
    assert "experts: 4 per layer over 2 ranks, 2 each (DeepSpeed AutoEP)" in split.stdout
    one = train_here(tmp_path / "cfg.yaml", tmp_path / "one", "parallel.engine=single", "parallel.expert_parallel=1",
                     "train.micro_batch_size=4")  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    for key in ("loss", "router_aux_loss", "grad_norm"):
        mine, theirs = metrics(tmp_path / "split"), metrics(tmp_path / "one")
        assert [r[key] for r in mine] == pytest.approx([r[key] for r in theirs], rel=1e-5, abs=1e-6), key
    final = "{}/checkpoints/final"
    assert_same_weights(weights(tmp_path / final.format("split")), weights(tmp_path / final.format("one")), 1e-5)


@pytest.mark.slow
def test_a_killed_expert_parallel_run_resumes_to_the_uninterrupted_result(expert_parallel_run, tmp_path):
    directory, _ = expert_parallel_run
    killed = launch(directory / "cfg.yaml", tmp_path / "run", ranks=2, fault="kill:1:3")
    assert killed.returncode != 0
    resumed = launch(directory / "cfg.yaml", tmp_path / "run", "--resume", "auto", ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step 2 of 4" in resumed.stdout
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(directory / "run")]
    final = directory / "run" / "checkpoints" / "final"
    assert_same_weights(weights(tmp_path / "run" / "checkpoints" / "final"), weights(final), 0.0)
    # A resume with the experts split otherwise is refused before the engine reads the shards.
    point = read_state(tmp_path / "run" / "checkpoints" / "step-2")
    assert point.expert_parallel == 2
    with pytest.raises(UserError, match=r"written with parallel\.expert_parallel=2, this run has 1"):
        check_compatible(
            point, tmp_path, world_size=2, micro_batch_size=2, gradient_accumulation=2, engine="deepspeed",
            sequence_parallel=1, expert_parallel=1,
        )  # fmt: skip


@pytest.mark.slow
def test_a_rank_missing_from_the_token_exchange_is_diagnosed(tmp_path):
    """Rank 1 stalls loading step 3's data; rank 0 waits in the step's first collective, the all-to-all that
    sends tokens to the experts' ranks, which the report names with its MoE block."""
    write_job(tmp_path)
    result = launch(tmp_path / "cfg.yaml", tmp_path / "run", ranks=2, fault="sleep_data:1:3:120", timeout=200)
    assert result.returncode != 0
    report = (tmp_path / "run" / "diagnostics" / "report.txt").read_text()
    assert report.startswith("tuneforge diagnosis: HANG"), report
    waiting = next(line for line in report.splitlines() if line.strip().startswith("rank 0"))
    assert "all_to_all_single" in waiting and "model.layers.1.mlp" in waiting, report


@pytest.mark.slow
def test_autoep_switched_on_behind_the_runs_back_is_refused_with_the_setting_to_use(tmp_path):
    write_job(tmp_path)
    (tmp_path / "ep.json").write_text('{"expert_parallel": {"enabled": true}}')  # AutoEP's default size
    result = launch(tmp_path / "cfg.yaml", tmp_path / "run", "parallel.expert_parallel=1",
                    f"parallel.deepspeed_config={tmp_path / 'ep.json'}", ranks=2)  # fmt: skip
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: parallel.deepspeed_config sets expert_parallel; set parallel.expert_parallel instead (the run "
        "checks the model for it, builds the optimizer's expert groups and gathers experts on save)"
    ]


def config(**parallel) -> Config:
    return Config.model_validate(
        {"model": {"architecture": "deepseek_v2", "tokenizer": "bytes"}, "data": {"train_files": ["x.jsonl"]},
         "parallel": {"engine": "deepspeed", "zero_stage": 2, **parallel}}
    )  # fmt: skip


class ModelConfig:
    def __init__(self, model_type: str, **fields):
        self.model_type = model_type
        self.__dict__.update(fields)


def test_what_expert_parallelism_cannot_run_is_refused_before_the_model_loads():
    deepseek = ModelConfig("deepseek_v2", n_routed_experts=64)
    assert expert_parallel_problems(config(expert_parallel=2), deepseek, 8) == (
        [],
        "experts: 64 per layer over 2 ranks, 32 each (DeepSpeed AutoEP)",
    )
    assert expert_parallel_problems(config(), deepseek, 8) == ([], "")
    problems, _ = expert_parallel_problems(config(expert_parallel=3), deepseek, 8)
    assert problems == [
        "parallel.expert_parallel=3 does not divide the model's 64 routed experts",
        "parallel.expert_parallel=3 does not divide the 8 processes launched",
    ]
    (problem,) = expert_parallel_problems(config(expert_parallel=2), ModelConfig("llama"), 2)[0]
    assert problem.startswith("parallel.expert_parallel: DeepSpeed's AutoEP has no preset for llama models")
    qwen = ModelConfig("qwen3_moe", num_experts=4)
    assert expert_parallel_problems(config(expert_parallel=2), qwen, 2)[1].startswith("experts: 4 per layer")
    (problem,) = expert_parallel_problems(config(expert_parallel=2), ModelConfig("qwen3_5_moe", num_experts=4), 2)[0]
    assert "AutoEP preset for qwen3_5_moe is for its vision-language form" in problem
    lora = Config.model_validate({**config(expert_parallel=2).model_dump(), "model": {
        "architecture": "deepseek_v2", "tokenizer": "bytes", "lora": {"r": 8}}})  # fmt: skip
    (problem,) = expert_parallel_problems(lora, deepseek, 2)[0]
    assert problem.startswith("parallel.expert_parallel: LoRA under expert parallelism is not supported")

    two = DistInfo(0, 2, 0, torch.device("cpu"))
    with pytest.raises(UserError, match=r"parallel\.expert_parallel needs parallel\.engine=deepspeed .*, not ddp"):
        choose_engine("ddp", two, config(expert_parallel=2).parallel)
    with pytest.raises(UserError, match=r"parallel\.expert_parallel runs with ZeRO 0-2"):
        choose_engine("deepspeed", two, config(expert_parallel=2, zero_stage=3).parallel)


MOE_FIELDS = {
    "deepseek_v2": dict(moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16, head_dim=8, num_key_value_heads=2),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      num_key_value_heads=2),
    "mixtral": dict(num_local_experts=4, num_key_value_heads=2, output_router_logits=True),
}  # fmt: skip
MOE_FIELDS["deepseek_v3"] = {**MOE_FIELDS["deepseek_v2"], "n_group": 1, "topk_group": 1}


def tiny_moe(model_type: str):
    from transformers import AutoConfig

    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_experts_per_tok=2, **MOE_FIELDS[model_type])  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))


@pytest.mark.slow  # DeepSpeed's table of compatible ops compiles probes with gcc; a DeepSpeed engine per model
def test_autoep_layers_compute_and_are_written_back_as_the_models_own(tmp_path, monkeypatch):
    """Every model type AutoEP runs with here: the converted model computes the same logits, and its weights
    come back under the model's own names and values. DeepSeek-V3 keeps a score correction bias on its gate,
    which AutoEP moves onto its router; Qwen2-MoE's shared expert is renamed by AutoEP; Mixtral and the Qwen
    models declare router-logit recorders, which AutoEP cannot retarget with this transformers and tuneforge does
    not need (the Mixtral here asks for router logits in its config: turned off). One process group for all
    models: DeepSpeed keeps its groups for the life of the process."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    from tuneforge.engines.deepspeed import skip_inference_only_kernels
    from tuneforge.engines.expert_parallel import (
        PRESETS,
        autoep_section,
        hugging_face_state_dict,
        without_router_logit_recorders,
    )

    skip_inference_only_kernels()  # as the engine does before DeepSpeed starts
    monkeypatch.setenv("LOCAL_RANK", "0")  # what the launcher sets, and DeepSpeed asserts
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    try:
        for model_type in PRESETS:
            model = tiny_moe(model_type)
            before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
            with torch.no_grad():
                logits = model(input_ids=tokens).logits
            assert without_router_logit_recorders(model) is (model_type == "mixtral")
            config = {"train_micro_batch_size_per_gpu": 1, "expert_parallel": autoep_section(1, model_type)}
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                              dist_init_required=False)  # fmt: skip
            assert any(name.endswith(".router.gate.weight") for name in engine.module.state_dict()), model_type
            with torch.no_grad():
                torch.testing.assert_close(engine.module(input_ids=tokens).logits, logits, msg=model_type)
            group = groups._get_expert_parallel_group("ep_size_1")
            assert_same_weights(hugging_face_state_dict(engine.module, group, True, before), before, atol=0)
    finally:
        dist.destroy_process_group()


LORA_REFUSAL = "parallel.expert_parallel: LoRA under expert parallelism is not supported"


def test_the_doctors_refusal_of_expert_parallelism_says_its_reason_once(tokenizer, monkeypatch):
    """The doctor's check carries its reasons, each with its fix, and no separate fix: the run's refusal says
    them (it once said `expert parallelism: ` and nothing more), as a refusal the ranks agreed on (rank 0 alone
    prints it), naming the rank where only another one failed."""
    from tuneforge.engines import EngineChoice
    from tuneforge.errors import SharedUserError
    from tuneforge.train import run

    lora = Config.model_validate({**config(expert_parallel=2).model_dump(), "model": {
        "architecture": "deepseek_v2", "tokenizer": "bytes", "lora": {"r": 8}}})  # fmt: skip
    rank0 = DistInfo(0, 2, 0, torch.device("cpu"))
    deepspeed = EngineChoice.of("deepspeed", lora.parallel, lora.train, "cpu")
    said = []
    monkeypatch.setattr(run, "gather_objects", lambda value, info: [value, value])  # both ranks find it
    with pytest.raises(SharedUserError) as refused:
        run.preflight(lora, deepspeed, rank0, tokenizer, 8, said.append)
    message = str(refused.value)
    assert message.startswith(f"doctor: expert parallelism: {LORA_REFUSAL}") and "\n" not in message
    assert "watchdog.doctor=warn" not in message and "FAIL  expert parallelism" in said[0]  # the run refuses it too
    monkeypatch.setattr(run, "gather_objects", lambda value, info: ["", value])  # rank 1 alone
    with pytest.raises(SharedUserError, match=r"^doctor \(rank 1\): expert parallelism: "):
        run.preflight(lora, deepspeed, rank0, tokenizer, 8, said.append)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "refusal"),
    [
        ("model.lora={r: 4}", f"doctor: expert parallelism: {LORA_REFUSAL}"),  # the doctor's, from the model
        ("parallel.engine=ddp", "parallel.expert_parallel needs parallel.engine=deepspeed"),  # the engine's
    ],
)
def test_a_refusal_every_rank_meets_is_said_once_with_its_reason(tmp_path, override, refusal):
    write_job(tmp_path)
    result = launch(tmp_path / "cfg.yaml", tmp_path / "run", override, ranks=2)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {refusal}"), errors
