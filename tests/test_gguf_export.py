"""`tuneforge export --format gguf`: every tensor under llama.cpp's name and layout, the tokenizer token for token,
the training template in the file and in the Modelfile, and refusals that name what would be lost."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from gguf_models import LLAMA3_SPLIT, QWEN2_SPLIT, bpe_tokenizer, save_checkpoint, tiny_model
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.data.conversation import Conversation, Turn
from tuneforge.data.templates import BUILT_IN, PromptTemplate
from tuneforge.errors import UserError
from tuneforge.gguf_export.export import export_gguf
from tuneforge.gguf_export.modelfile import go_template
from tuneforge.gguf_export.tensors import _unpair_rotation
from tuneforge.gguf_export.vocab import pre_tokenizer_scheme

from conftest import DEMO_TEMPLATE, REPO, adapter_checkpoint, demo_tokenizer, train_here, tuneforge_here

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2"]
GO_RENDER = Path(__file__).parent / "assets" / "render_go_template.go"


def fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    reader = gguf.GGUFReader(path)
    out = {}
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        out[tensor.name] = torch.from_numpy(data.copy()).float()
    return out


@pytest.fixture(scope="module")
def byte_tokenizer():
    return build_byte_tokenizer()


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_every_weight_lands_under_a_name_llama_cpp_reads(model_type, byte_tokenizer, tmp_path):
    model = tiny_model(model_type, byte_tokenizer)
    checkpoint = save_checkpoint(model, byte_tokenizer, tmp_path / "ckpt")
    export_gguf(checkpoint, tmp_path / "out", "f32")
    written = tensors(tmp_path / "out" / "model.gguf")
    state = model.state_dict()
    assert sum(t.numel() for t in written.values()) == sum(t.numel() for t in state.values())
    assert torch.equal(written["token_embd.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(written["output.weight"], state["lm_head.weight"])
    assert torch.equal(written["blk.1.attn_output.weight"], state["model.layers.1.self_attn.o_proj.weight"])
    if model_type in ("qwen3_moe", "deepseek_v2"):
        gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
        width = gate_up.shape[1] // 2
        assert torch.equal(written["blk.1.ffn_gate_exps.weight"], gate_up[:, :width])
        assert torch.equal(written["blk.1.ffn_up_exps.weight"], gate_up[:, width:])
        assert torch.equal(written["blk.1.ffn_down_exps.weight"], state["model.layers.1.mlp.experts.down_proj"])
    meta = fields(tmp_path / "out" / "model.gguf")
    arch = meta["general.architecture"]
    assert meta[f"{arch}.block_count"] == 2
    assert meta["tokenizer.ggml.tokens"] == [
        byte_tokenizer.convert_ids_to_tokens(i) for i in range(len(byte_tokenizer))
    ]
    assert meta["tokenizer.ggml.eos_token_id"] == byte_tokenizer.eos_token_id


def test_llama_query_and_key_rows_are_reordered_for_adjacent_pair_rotation(byte_tokenizer, tmp_path):
    model = tiny_model("llama", byte_tokenizer)
    export_gguf(save_checkpoint(model, byte_tokenizer, tmp_path / "ckpt"), tmp_path / "out", "f32")
    written = tensors(tmp_path / "out" / "model.gguf")
    query = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(written["blk.0.attn_q.weight"], query)
    # head 0's first rows in llama.cpp's order: row 0 of the first half, row 0 of the second half, row 1, ...
    half = query.shape[0] // 4 // 2
    assert torch.equal(written["blk.0.attn_q.weight"][1], query[half])
    assert torch.equal(written["blk.0.attn_q.weight"][2], query[1])
    assert torch.equal(
        _unpair_rotation(torch.arange(8.0).reshape(8, 1), 1).flatten(), torch.tensor([0, 4, 1, 5, 2, 6, 3, 7.0])
    )


def test_outtypes_keep_norms_and_routers_in_32_bits(byte_tokenizer, tmp_path):
    model = tiny_model("qwen3_moe", byte_tokenizer)
    checkpoint = save_checkpoint(model, byte_tokenizer, tmp_path / "ckpt")
    export_gguf(checkpoint, tmp_path / "q8", "q8_0")
    reader = gguf.GGUFReader(tmp_path / "q8" / "model.gguf")
    kinds = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert kinds["blk.0.attn_norm.weight"] == "F32"
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32"
    assert kinds["blk.0.attn_q.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_down_exps.weight"] == "F16"  # rows of 16 values: no whole 32-value block
    original = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(tensors(tmp_path / "q8" / "model.gguf")["blk.0.attn_q.weight"], original, atol=0.01)


def test_a_weight_without_a_llama_cpp_name_is_refused_by_name(byte_tokenizer, tmp_path):
    model = tiny_model("llama", byte_tokenizer)
    model.model.register_buffer("extra_head", torch.ones(3), persistent=True)
    checkpoint = save_checkpoint(model, byte_tokenizer, tmp_path / "ckpt")
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    weights["model.mtp.0.proj.weight"] = torch.ones(4, 4)
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"would be lost: .*model\.mtp\.0\.proj\.weight"):
        from tuneforge.gguf_export.architectures import facts
        from tuneforge.gguf_export.tensors import gguf_tensors

        list(gguf_tensors(weights, model.config, facts(model.config)))


def test_a_name_llama_cpp_does_not_read_one_written_twice_or_a_layer_left_out_is_refused(byte_tokenizer):
    from tuneforge.gguf_export.architectures import facts
    from tuneforge.gguf_export.tensors import check_names, gguf_tensors

    model = tiny_model("llama", byte_tokenizer)
    found = facts(model.config)
    names = [name for name, _ in gguf_tensors(model.state_dict(), model.config, found)]
    check_names(names, found)  # the conversion's own names pass
    with pytest.raises(UserError, match=r"llama.cpp's llama reads no tensor named blk\.0\.attn_qq\.weight"):
        check_names([*names, "blk.0.attn_qq.weight"], found)
    with pytest.raises(UserError, match=r"tensors written twice: blk\.0\.attn_q\.weight$"):
        check_names([*names, "blk.0.attn_q.weight"], found)
    with pytest.raises(UserError, match=r"no weights for layer\(s\) \[1\]"):
        check_names([name for name in names if not name.startswith("blk.1.")], found)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"architecture": "gpt2"}, r"'gpt2' architecture is not converted .* llama, mistral"),
        ({"norm_topk_prob": False}, r"norm_topk_prob=False is not converted"),
    ],
)
def test_what_llama_cpp_would_compute_differently_is_refused(change, refusal, byte_tokenizer, tmp_path):
    if "architecture" in change:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(byte_tokenizer), n_embd=32, n_layer=1, n_head=2))
    else:
        model = tiny_model("qwen3_moe", byte_tokenizer, **change)
    checkpoint = save_checkpoint(model, byte_tokenizer, tmp_path / "ckpt")
    with pytest.raises(UserError, match=refusal):
        export_gguf(checkpoint, tmp_path / "out", "f16")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".tmp-out").exists()


@pytest.mark.parametrize(("split", "scheme"), [(LLAMA3_SPLIT, "llama-bpe"), (QWEN2_SPLIT, "qwen2"), (None, "gpt-2")])
def test_the_pre_tokenizer_is_recognised_by_how_it_splits(split, scheme):
    tokenizer = bpe_tokenizer(split)
    assert pre_tokenizer_scheme(tokenizer, has_merges=True) == scheme


def test_a_pre_tokenizer_llama_cpp_does_not_reproduce_is_refused():
    tokenizer = bpe_tokenizer(r"\p{L}+|\s+|.")
    with pytest.raises(UserError, match=r"none of llama\.cpp's pre-tokenizers"):
        pre_tokenizer_scheme(tokenizer, has_merges=True)


CONVERSATION = [
    {"role": "system", "content": "Answer in decimal."},
    {"role": "user", "content": "#ff8800"},
    {"role": "assistant", "content": "255,136,0"},
    {"role": "user", "content": "and"},
    {"role": "user", "content": "#0066ee?"},
]


def _jinja_render(template: str, tokenizer) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(
        messages=CONVERSATION, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, add_generation_prompt=True
    )


def _tuneforge_render(template: PromptTemplate, tokenizer) -> str:
    turns = [
        Turn(user="#ff8800", assistant="255,136,0", system="Answer in decimal."),
        Turn(user="and\n#0066ee?", assistant=None),
    ]
    return template.render(Conversation(turns=tuple(turns), origin="test"), tokenizer, None)


@pytest.mark.parametrize("name", ["deepseek_coder", "qwen_chat", "llama3_chat"])
def test_the_training_template_travels_in_the_gguf(name, byte_tokenizer, tmp_path):
    model = tiny_model("qwen2", byte_tokenizer)
    checkpoint = save_checkpoint(model, byte_tokenizer, tmp_path / "ckpt", template=name)
    export_gguf(checkpoint, tmp_path / "out", "f16")
    meta = fields(tmp_path / "out" / "model.gguf")
    expected = _tuneforge_render(BUILT_IN[name], byte_tokenizer)
    assert _jinja_render(meta["tokenizer.chat_template"], byte_tokenizer) == expected
    modelfile = (tmp_path / "out" / "Modelfile").read_text()
    for stop in BUILT_IN[name].stop_strings(byte_tokenizer):
        assert f"PARAMETER stop {json.dumps(stop, ensure_ascii=False)}" in modelfile
    assert modelfile.startswith('FROM ./model.gguf\nTEMPLATE """')


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("go") is None, reason="Go's text/template (Ollama's) needs a Go toolchain")
@pytest.mark.parametrize("name", ["deepseek_coder", "qwen_chat", "llama3_chat", "mistral"])
def test_the_modelfile_template_renders_as_training_did_in_go(name, byte_tokenizer, tmp_path):
    template = BUILT_IN[name]
    (tmp_path / "template.tmpl").write_text(go_template(template, "<s>", "</s>", "Be exact."))
    (tmp_path / "messages.json").write_text(json.dumps(CONVERSATION[1:]))
    rendered = subprocess.run(
        ["go", "run", str(GO_RENDER), str(tmp_path / "template.tmpl"), str(tmp_path / "messages.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rendered.returncode == 0, rendered.stderr
    turns = [Turn(user="#ff8800", assistant="255,136,0"), Turn(user="and\n#0066ee?", assistant=None)]
    assert rendered.stdout == template.render(
        Conversation(turns=tuple(turns), origin="test"), byte_tokenizer, "Be exact."
    )


# llama.cpp itself (the `gguf` extra's llama-cpp-python) reads the files back.
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the llamacpp extra) is not installed"
)
TEXT = "The quick brown fox: #ff8800 is 255,136,0. It's 2026!\n中文 ünïcödé  spaces\tand tabs"


def _llama(path: Path, **settings):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False, **settings)


ROPE_VARIANTS = {
    "llama-rope-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2-rope-linear": ("qwen2", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "deepseek_v2-q-lora-yarn": (
        "deepseek_v2",
        {
            "q_lora_rank": 16,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        },
    ),
}
VARIANTS = {**{name: (name, {}) for name in ARCHITECTURES}, **ROPE_VARIANTS}


@needs_llama_cpp
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_computes_the_same_logits(variant, byte_tokenizer, tmp_path):
    model_type, changes = VARIANTS[variant]
    model = tiny_model(model_type, byte_tokenizer, **changes)
    export_gguf(save_checkpoint(model, byte_tokenizer, tmp_path / "ckpt"), tmp_path / "out", "f32")
    ids = byte_tokenizer(TEXT, add_special_tokens=False)["input_ids"][:48]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = _llama(tmp_path / "out" / "model.gguf", logits_all=True)
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 2e-3 * scale, (np.abs(got - expected).max(), scale)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@needs_llama_cpp
@pytest.mark.parametrize("split", [LLAMA3_SPLIT, QWEN2_SPLIT, None], ids=["llama3", "qwen2", "gpt2"])
def test_llama_cpp_tokenizes_as_transformers_does(split, tmp_path):
    from gguf_models import CORPUS
    from tuneforge.gguf_export.vocab import PROBE

    tokenizer = bpe_tokenizer(split)
    model = tiny_model("llama", tokenizer)
    export_gguf(save_checkpoint(model, tokenizer, tmp_path / "ckpt"), tmp_path / "out", "f16")
    llm = _llama(tmp_path / "out" / "model.gguf", vocab_only=True)
    for text in [PROBE, TEXT, *CORPUS[:4], "<|begin|>hi<|end|>"]:
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == expected, text


def test_one_conversation_renders_the_same_through_every_export(tmp_path):
    """The run's template and stops in the adapter, the merged model, the GGUF and its Modelfile, and the
    server adapter's chat_template.jinja: one conversation rendered through each (transformers' own template
    engine for the first two) gives the string training saw."""
    from tuneforge.export import export

    checkpoint = adapter_checkpoint(tmp_path / "run", trained=True)
    tokenizer = demo_tokenizer()
    export(checkpoint, tmp_path / "adapter", merge=False, dtype_name=None)
    export(checkpoint, tmp_path / "merged", merge=True, dtype_name=None)
    export_gguf(checkpoint, tmp_path / "gguf", "f16")
    served = tuneforge_here("export", str(checkpoint), "--out", str(tmp_path / "vllm"), "--for", "vllm")
    assert served.returncode == 0, served.stderr
    assert f"--chat-template {tmp_path / 'vllm' / 'chat_template.jinja'}" in served.stdout
    template = PromptTemplate(**{**DEMO_TEMPLATE, "stop_words": ()})
    expected = _tuneforge_render(template, tokenizer)
    for directory in ("adapter", "merged"):
        saved = AutoTokenizer.from_pretrained(tmp_path / directory)
        assert saved.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True) == expected
    meta = fields(tmp_path / "gguf" / "model.gguf")
    assert _jinja_render(meta["tokenizer.chat_template"], tokenizer) == expected
    assert _jinja_render((tmp_path / "vllm" / "chat_template.jinja").read_text(), tokenizer) == expected
    modelfile = (tmp_path / "gguf" / "Modelfile").read_text()
    assert 'PARAMETER stop "</s>"' in modelfile
    go = go_template(template, tokenizer.bos_token, tokenizer.eos_token, None)
    assert f'TEMPLATE """{go}"""' in modelfile


def test_the_training_templates_stop_tokens_travel_into_every_export(tmp_path):
    """A template whose replies end with a stop word of one token (as `<|eot_id|>` or `<|im_end|>`): the adapter's
    and the vLLM adapter's generation_config.json, the merged model's generation config, the GGUF (its end-of-turn
    token) and the Modelfile all stop there as well as at the EOS; the base's own stops are kept."""
    from transformers import GenerationConfig

    from tuneforge.export import export

    checkpoint = adapter_checkpoint(tmp_path / "run", trained=True)
    base = tmp_path / "run" / "base"
    # The base's own extra stop, and sampling settings that transformers' own save would refuse as they are.
    base_config = {"eos_token_id": [7], "bos_token_id": 1, "temperature": 0.6, "top_p": 0.9}
    (base / "generation_config.json").write_text(json.dumps(base_config))
    (checkpoint / "tuneforge.json").write_text(json.dumps({"template": {**DEMO_TEMPLATE, "stop_words": [";"]}}))
    tokenizer = demo_tokenizer()
    eos, stop = tokenizer.eos_token_id, tokenizer(";", add_special_tokens=False)["input_ids"][0]
    lines = export(checkpoint, tmp_path / "adapter", merge=False, dtype_name=None)
    assert f"stops at token ids {[eos, stop]}" in "\n".join(lines)
    export(checkpoint, tmp_path / "merged", merge=True, dtype_name=None)
    export_gguf(checkpoint, tmp_path / "gguf", "f16")
    served = tuneforge_here("export", str(checkpoint), "--out", str(tmp_path / "vllm"), "--for", "vllm")
    assert served.returncode == 0, served.stderr
    assert f"--generation-config {tmp_path / 'vllm'}" in served.stdout
    for directory in ("adapter", "merged", "vllm"):
        written = GenerationConfig.from_pretrained(tmp_path / directory)
        assert (written.eos_token_id, written.temperature) == ([eos, stop, 7], 0.6), directory
    meta = fields(tmp_path / "gguf" / "model.gguf")
    assert (meta["tokenizer.ggml.eos_token_id"], meta["tokenizer.ggml.eot_token_id"]) == (eos, stop)
    # The BOS as the tokenizer adds it: llama.cpp prepends it to the rendered chat as transformers does.
    adds_bos = tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.add_bos_token"]) == (
        tokenizer.bos_token_id,
        adds_bos,
    )
    modelfile = (tmp_path / "gguf" / "Modelfile").read_text()
    assert 'PARAMETER stop "</s>"' in modelfile and 'PARAMETER stop ";"' in modelfile
    (base / "generation_config.json").write_text("{not json")  # a damaged file handed over with the base
    with pytest.raises(UserError, match=r"generation_config\.json: not a readable generation config .*fix or remove"):
        export(checkpoint, tmp_path / "again", merge=False, dtype_name=None)
    assert not (tmp_path / "again").exists()


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_the_trained_demo_answers_in_llama_cpp_as_in_transformers(outtype, tmp_path_factory):
    """The demo trained briefly, exported through the CLI; llama.cpp's chat completion (the GGUF's own chat
    template, rendered by llama-cpp-python) gives the same greedy replies to held-out prompts as tuneforge's
    generation from the checkpoint."""
    from tuneforge.data.templates import recorded_template
    from tuneforge.generate import generate_replies
    from tuneforge.trained import load_trained

    checkpoint = _trained_demo(tmp_path_factory)
    out = tmp_path_factory.mktemp("gguf") / outtype
    exported = tuneforge_here("export", str(checkpoint), "--out", str(out), "--format", "gguf", "--outtype", outtype)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "exported GGUF" in exported.stdout
    heldout = [json.loads(line) for line in (REPO / "configs/data/hex_rgb_heldout.jsonl").read_text().splitlines()]
    prompts = [record["messages"][0]["content"] for record in heldout[:24]]
    trained = load_trained(checkpoint)
    template = recorded_template(trained.meta["template"], checkpoint)
    conversations = [Conversation(turns=(Turn(user=p, assistant=None),), origin="test") for p in prompts]
    expected = generate_replies(trained.model, trained.tokenizer, template, conversations, None, max_new_tokens=24)
    # Trained enough that replies are answers (near the right triple after 300 steps), not noise.
    assert sum(bool(re.fullmatch(r"\(\d+, \d+, \d+\)", reply)) for reply in expected) >= 20, expected
    llm = _llama(out / "model.gguf")
    got = []
    for prompt in prompts:
        answer = llm.create_chat_completion([{"role": "user", "content": prompt}], temperature=0.0, max_tokens=24)
        got.append(answer["choices"][0]["message"]["content"])
    same = sum(a == b for a, b in zip(got, expected, strict=True))
    pairs = list(zip(got, expected, strict=True))
    # A near-tie between two tokens can go either way between two float implementations: on 200 held-out prompts
    # 199 (f32) and 198 (q8_0) replies agree (README); here 24 of them.
    assert same >= len(prompts) - (1 if outtype == "f32" else 2), pairs


_DEMO_RUN: dict[str, Path] = {}


def _trained_demo(tmp_path_factory) -> Path:
    """The demo trained 300 steps in fp32, once per session."""
    if "checkpoint" not in _DEMO_RUN:
        work_dir = tmp_path_factory.mktemp("demo_gguf")
        overrides = [
            "train.max_steps=300",
            "train.precision=fp32",
            "checkpoint.every_steps=1000",
            "eval.sample_prompts=[]",
            "eval.exact_match=null",
            "log.plot=false",
        ]
        trained = train_here(REPO / "configs" / "demo.yaml", work_dir, *overrides)
        assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
        _DEMO_RUN["checkpoint"] = work_dir / "checkpoints" / "final"
    return _DEMO_RUN["checkpoint"]
