"""Formats, templates, labels, truncation and the byte tokenizer."""

from __future__ import annotations

import pytest

from tuneforge.config.schema import TemplateConfig
from tuneforge.data.byte_tokenizer import build_byte_tokenizer
from tuneforge.data.conversation import Conversation, SampleError, Turn
from tuneforge.data.formats import detect_format, to_conversation
from tuneforge.data.templates import IGNORE_INDEX, get_template
from tuneforge.errors import UserError

from conftest import chat, tokenized


def trained_text(tokenizer, data, index: int = 0) -> tuple[str, str]:
    """(whole text, trained text) of a tokenized sample."""
    ids, labels = data.sample(index)
    trained = [int(t) for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    return tokenizer.decode(ids.tolist()), tokenizer.decode(trained)


TWO_TURNS = Conversation(
    (Turn("Hi", "Hello", True, "Be brief."), Turn("Bye", "Ciao", True)),
    "mem:1",
)
DEEPSEEK_CODER_SYSTEM = (
    "You are an AI programming assistant, utilizing the DeepSeek Coder model, developed by DeepSeekCompany, "
    "and you only answer questions related to computer science. For politically sensitive questions, security "
    "and privacy issues, and other non-computer science questions, you will refuse to answer. "
)
CHATML = (
    "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    "Hello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nCiao<|im_end|>\n"
)
INST = "<s>[INST] Be brief. [/INST]\n[INST] Hi [/INST]Hello</s>\n<s>[INST] Bye [/INST]Ciao</s>\n"
EXPECTED = {
    "deepseek_coder": (
        f"<s>{DEEPSEEK_CODER_SYSTEM}Be brief.\n### Instruction:\nHi\n### Response:\nHello</s>\n"
        "<s>### Instruction:\nBye\n### Response:\nCiao</s>\n"
    ),
    "deepseek_v2": (
        "<s>Be brief.\n\nUser: Hi\n\nAssistant: Hello<｜end▁of▁sentence｜>User: Bye\n\nAssistant: "
        "Ciao<｜end▁of▁sentence｜>"
    ),
    "llama3_chat": (
        "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "Hello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nCiao<|eot_id|>"
    ),
    "qwen_chat": CHATML,
    "internlm2_chat": CHATML,
    "mistral": INST,
    "mixtral": INST,
    "zephyr": (
        "<s><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello</s>\n<s><|user|>\nBye\n<|assistant|>\nCiao</s>\n"
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_built_in_template_renders_xtuner_text(tokenizer, name):
    assert get_template(name).render(TWO_TURNS, tokenizer, None) == EXPECTED[name]


def test_every_built_in_template_has_a_literal_test():
    from tuneforge.data.templates import BUILT_IN

    assert set(BUILT_IN) == set(EXPECTED)


def test_generation_prompt_ends_where_the_reply_starts(tokenizer):
    prompt = Conversation((Turn("Hi", None, True, "Be brief."),), "<prompt>")
    text = get_template("qwen_chat").render(prompt, tokenizer, None)
    assert text == "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_replies_and_their_eos_are_trained_and_prompts_are_not(tokenizer):
    data = tokenized(tokenizer, [chat("Convert #0066ee to RGB.", "(0, 102, 238)")])
    assert trained_text(tokenizer, data) == (
        "<s>### Instruction:\nConvert #0066ee to RGB.\n### Response:\n(0, 102, 238)</s>\n",
        "(0, 102, 238)</s>",
    )


def test_suffix_as_eos_trains_the_suffix_instead_of_eos(tokenizer):
    data = tokenized(tokenizer, [chat("Hi", "Hello")], template="deepseek_v2")
    assert trained_text(tokenizer, data)[1] == "Hello<｜end▁of▁sentence｜>"


def test_loss_false_reply_is_context_only_and_string_flags_work(tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "first", "loss": "false"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "second", "loss": "true"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "third", "loss": False},
        ]
    }
    assert trained_text(tokenizer, tokenized(tokenizer, [record]))[1] == "second</s>"


def test_a_null_loss_flag_is_an_absent_one(tokenizer):
    """Parquet files and saved datasets give every message a `loss` field when some messages have one: null in the
    others. Those messages train as if the field were absent; the record is not dropped."""
    record = {
        "messages": [
            {"role": "user", "content": "a", "loss": None},
            {"role": "assistant", "content": "first", "loss": False},
            {"role": "user", "content": "b", "loss": None},
            {"role": "assistant", "content": "second", "loss": None},
        ]
    }
    assert trained_text(tokenizer, tokenized(tokenizer, [record]))[1] == "second</s>"


def test_default_system_applies_only_without_one(tokenizer):
    template = get_template(TemplateConfig(system="S:{system}|", instruction="U:{input}|"))
    plain = Conversation((Turn("q", "a"),), "m")
    assert template.render(plain, tokenizer, "dflt") == "<s>S:dflt|U:q|a</s>"
    assert template.render(TWO_TURNS, tokenizer, "dflt").startswith("<s>S:Be brief.|U:Hi|")


def test_an_inline_custom_template(tokenizer):
    data = tokenized(tokenizer, [chat("hi", "ok")], template=TemplateConfig(instruction="Q: {input}\nA: ", sep="\n"))
    assert trained_text(tokenizer, data) == ("<s>Q: hi\nA: ok</s>\n", "ok</s>")


CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tokenizer_template_finds_trained_spans_by_rendering():
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = CHATML_JINJA
    record = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Ciao", "loss": False},
        ]
    }
    data = tokenized(tokenizer, [record], template="tokenizer")
    text, trained = trained_text(tokenizer, data)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nCiao<|im_end|>\n"
    )
    assert trained == "Hello<|im_end|>\n"


def test_tokenizer_template_that_rewrites_history_is_refused():
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(UserError, match="does not render a conversation as the extension of its prefix"):
        tokenized(tokenizer, [chat("Hi", "Hello")], template="tokenizer")


def test_the_tokenizers_template_with_a_python_tokenizer_is_refused_with_the_fix():
    from transformers import ByT5Tokenizer  # a tokenizer written in Python: no character offsets

    slow = ByT5Tokenizer()
    slow.chat_template = CHATML_JINJA
    with pytest.raises(UserError, match=r"ByT5Tokenizer is not a fast tokenizer, .*pick a built-in template"):
        tokenized(slow, [chat("Hi", "Hello")], template="tokenizer")


def test_negative_seeds_are_refused_with_the_config_error(tmp_path):
    from tuneforge.config.load import load_config

    (tmp_path / "cfg.yaml").write_text("model: {architecture: llama}\ndata: {train_files: [x.jsonl]}\n")
    for override in ("train.seed=-1", "data.split_seed=-3"):
        with pytest.raises(UserError, match="greater than or equal to 0"):
            load_config(tmp_path / "cfg.yaml", [override])


def test_sharegpt_and_alpaca_convert_to_the_same_turns():
    sharegpt = {"system": "S", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    alpaca = {"instruction": "q", "input": "", "output": "a", "system": "S"}
    openai = {
        "messages": [{"role": "system", "content": "S"}, chat("q", "a")["messages"][0], chat("q", "a")["messages"][1]]
    }
    turns = [to_conversation(r, detect_format(r), "m").turns for r in (sharegpt, alpaca, openai)]
    assert turns[0] == turns[1] == turns[2] == (Turn("q", "a", True, "S"),)
    with_input = {"instruction": "Translate", "input": "hola", "output": "hello"}
    assert to_conversation(with_input, "alpaca", "m").turns[0].user == "Translate\nhola"


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "missing content"),
        ({"messages": []}, "empty conversation"),
        ({"messages": [{"role": "system", "content": "s"}]}, "empty conversation"),
        ({"messages": [{"role": "user", "content": "q"}]}, "ends on a user turn"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "assistant without a user turn"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss": "maybe"}]},
            "invalid loss flag",
        ),
        ({"messages": "hello"}, "malformed record"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown role"),
        ({"instruction": "", "output": "x"}, "missing content"),
    ],
)
def test_unusable_records_raise_a_sample_error_with_its_reason(record, reason):
    with pytest.raises(SampleError) as info:
        to_conversation(record, detect_format(record), "m")
    assert info.value.reason == reason


def test_truncate_keeps_whole_leading_turns(tokenizer):
    record = {
        "messages": [*chat("a", "one")["messages"], *chat("b", "two")["messages"], *chat("c", "three")["messages"]]
    }
    full = tokenized(tokenizer, [record])
    two_turns = len(
        tokenizer(
            "<s>### Instruction:\na\n### Response:\none</s>\n<s>### Instruction:\nb\n### Response:\ntwo</s>\n",
            add_special_tokens=False,
        )["input_ids"]
    )
    cut = tokenized(tokenizer, [record], max_length=two_turns + 3, truncation="truncate")
    assert int(full.lengths[0]) > two_turns
    assert int(cut.lengths[0]) == two_turns
    assert trained_text(tokenizer, cut)[1] == "one</s>two</s>"


def test_a_sample_cut_to_untrained_turns_is_dropped_for_its_length_and_not_counted_as_truncated(tokenizer):
    """Its first reply is context only (`loss: false`), its second too long to fit: truncation keeps the first
    turn, which trains nothing. Dropped as too long (its length is the reason), and not among the truncated."""
    from tuneforge.data.report import DropLog
    from tuneforge.data.tokenize import NO_TARGET, TOO_LONG, tokenize

    first = chat("a", "one")["messages"]
    first[1]["loss"] = False
    record = {"messages": [*first, *chat("b", "two " * 200)["messages"]]}
    conversation = to_conversation(record, detect_format(record), "mem:1")
    drops = DropLog()
    kept, truncated = tokenize([conversation], tokenizer, get_template("deepseek_coder"), 64, "truncate", None, drops)
    assert kept == [] and truncated == 0
    assert drops.counts == {TOO_LONG: 1} and NO_TARGET not in drops.counts


def test_byte_tokenizer_round_trips_any_text(tokenizer):
    text = "Convert #0066ee to RGB. 写一个 Python 函数 ✓"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tokenizer) == 260
