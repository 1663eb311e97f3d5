"""Conversations, the template, labels and batching on the local byte tokenizer."""

from __future__ import annotations

import pytest

from tuneforge.data.batching import EpochBatches, collate
from tuneforge.data.conversation import load_conversations, parse_messages
from tuneforge.data.templates import get_template, render
from tuneforge.data.tokenize import IGNORE_INDEX, tokenize_conversations
from tuneforge.errors import UserError

from conftest import chat, write_jsonl

TEMPLATE = get_template("deepseek_coder")


def labelled_text(tokenizer, sample) -> tuple[str, str]:
    """(whole text, the trained part) of a tokenized sample."""
    trained = [t for t, label in zip(sample.input_ids, sample.labels, strict=True) if label != IGNORE_INDEX]
    return tokenizer.decode(sample.input_ids), tokenizer.decode(trained)


def test_byte_tokenizer_round_trips_any_text(tokenizer):
    text = "Convert #0066ee to RGB. 写一个 Python 函数 ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 260


def test_deepseek_coder_renders_xtuner_layout(tokenizer):
    conv = parse_messages(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao"},
            ]
        },
        "mem:1",
    )
    text = "".join(s.text for s in render(TEMPLATE, conv, "<s>", "</s>"))
    assert text == (
        "<s>You are an AI programming assistant, utilizing the DeepSeek Coder model, developed by DeepSeekCompany, "
        "and you only answer questions related to computer science. For politically sensitive questions, security "
        "and privacy issues, and other non-computer science questions, you will refuse to answer. Be brief.\n"
        "### Instruction:\nHi\n### Response:\nHello</s>\n"
        "<s>### Instruction:\nBye\n### Response:\nCiao</s>\n"
    )


def test_assistant_replies_and_their_eos_are_trained(tokenizer):
    conv = parse_messages(chat("Convert #0066ee to RGB.", "(0, 102, 238)"), "mem:1")
    [sample], _ = tokenize_conversations([conv], tokenizer, TEMPLATE, 512)
    text, trained = labelled_text(tokenizer, sample)
    assert text == "<s>### Instruction:\nConvert #0066ee to RGB.\n### Response:\n(0, 102, 238)</s>\n"
    assert trained == "(0, 102, 238)</s>"


def test_loss_false_reply_is_context_only_and_string_flags_work(tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "first", "loss": "false"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "second", "loss": "true"},
        ]
    }
    [sample], _ = tokenize_conversations([parse_messages(record, "mem:1")], tokenizer, TEMPLATE, 512)
    assert labelled_text(tokenizer, sample)[1] == "second</s>"


def test_over_length_and_untrained_samples_are_dropped_and_counted(tokenizer):
    conversations = [
        parse_messages(chat("short", "ok"), "f.jsonl:1"),
        parse_messages(chat("x" * 300, "ok"), "f.jsonl:2"),
        parse_messages(chat("y", "no", loss=False), "f.jsonl:3"),
    ]
    samples, report = tokenize_conversations(conversations, tokenizer, TEMPLATE, 100)
    assert [s.origin for s in samples] == ["f.jsonl:1"]
    assert (report.kept, report.dropped_too_long, report.dropped_no_target) == (1, 1, 1)
    assert report.longest_dropped.startswith("f.jsonl:2 (")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": [{"role": "user", "content": "a"}', "f.jsonl:2: not valid JSON"),
        ('{"messages": [{"role": "robot", "content": "a"}]}', "f.jsonl:2: messages[0]: role must be one of"),
        ('{"messages": [{"role": "user", "content": "a"}]}', "f.jsonl:2: a conversation must end with an assistant"),
        ('{"messages": [{"role": "assistant", "content": "a"}]}', "f.jsonl:2: messages[0] has role 'assistant'"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "loss": "maybe"}]}',
            "f.jsonl:2: messages[1]: `loss` must be true or false",
        ),
        ('{"text": "hello"}', 'f.jsonl:2: expected an object with a "messages" list'),
    ],
)
def test_bad_records_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "f.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n' + line + "\n"
    )
    with pytest.raises(UserError) as info:
        load_conversations([str(path)])
    assert str(info.value).startswith(str(tmp_path / message))


def test_collate_shifts_targets_and_masks_padding(tokenizer):
    convs = [parse_messages(chat("a", "bc"), "m:1"), parse_messages(chat("long question", "d"), "m:2")]
    samples, _ = tokenize_conversations(convs, tokenizer, TEMPLATE, 512)
    batch = collate(samples, tokenizer.pad_token_id)
    short = len(samples[0].input_ids)
    assert batch.attention_mask[0].sum() == short
    assert batch.input_ids[0, short:].eq(tokenizer.pad_token_id).all()
    assert batch.targets[0, : short - 1].tolist() == samples[0].labels[1:]
    assert batch.targets[0, short - 1 :].eq(IGNORE_INDEX).all()
    assert batch.num_targets == 3 + 2  # "b", "c", EOS and "d", EOS


def test_epoch_order_depends_only_on_seed_and_epoch(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", f"a{i}") for i in range(10)])
    samples, _ = tokenize_conversations(load_conversations([str(path)]), tokenizer, TEMPLATE, 512)
    batches = EpochBatches(samples, 3, tokenizer.pad_token_id, shuffle=True, seed=7)
    order = [o for b in batches.epoch(0) for o in b.origins]
    assert sorted(order) == sorted(s.origin for s in samples)
    assert order == [o for b in batches.epoch(0) for o in b.origins]
    assert order != [o for b in batches.epoch(1) for o in b.origins]
    assert len(batches) == 4


def test_an_inline_custom_template_renders_like_a_built_in_one(tokenizer):
    from tuneforge.config.schema import TemplateConfig

    template = get_template(TemplateConfig(instruction="Q: {input}\nA: ", sep="\n", suffix="!"))
    [sample], _ = tokenize_conversations([parse_messages(chat("hi", "ok"), "m:1")], tokenizer, template, 512)
    assert labelled_text(tokenizer, sample) == ("<s>Q: hi\nA: ok!</s>\n", "ok!</s>")
