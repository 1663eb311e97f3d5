"""Pairs a user may write by mistake, as `tuneforge data check` and `data preview` show them: one answer a whole
conversation and the other a bare answer (which would train them after two different prompts), and empty or
blank answers and prompts. Each is dropped and counted with a reason that says what to fix."""

from __future__ import annotations

import re

from test_preference import DPO_CONFIG, pair

from conftest import tuneforge_here, write_jsonl


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


MIXED = [
    # The prompt repeated inside `chosen`: chosen would train after the question twice, rejected once.
    {"prompt": "Convert #1.", "chosen": [user("Convert #1."), assistant("(0, 0, 1)")], "rejected": "0 0 1"},
    # Another question inside `chosen`: the two answers would answer different prompts.
    {"prompt": "Convert #2.", "chosen": [user("Convert #3."), assistant("(0, 0, 3)")], "rejected": "0 0 2"},
    # No `prompt` field: the whole conversation is `rejected` this time.
    {"chosen": "(0, 0, 4)", "rejected": [user("Convert #4."), assistant("0 0 4")]},
]
BLANK_ANSWERS = [
    {"prompt": "Convert #5.", "chosen": "", "rejected": "0 0 5"},
    {"prompt": [user("Convert #6.")], "chosen": [assistant("(0, 0, 6)")], "rejected": [assistant(" \n\t")]},
]
BLANK_PROMPTS = [
    {"prompt": "", "chosen": "(0, 0, 7)", "rejected": "0 0 7"},
    {"prompt": "   ", "chosen": "(0, 0, 8)", "rejected": "0 0 8"},
    {"chosen": [user(" "), assistant("(0, 0, 9)")], "rejected": [user(" "), assistant("0 0 9")]},
]
EMPTY_SYSTEM = {
    "prompt": [{"role": "system", "content": ""}, user("Convert #a.")],
    "chosen": "(0, 0, 10)",
    "rejected": "x",
}
"""An empty system message is no system prompt, as many datasets write it: the pair is kept."""


def write_job(tmp_path, rows: list[dict]):
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    (tmp_path / "cfg.yaml").write_text(DPO_CONFIG)
    return str(tmp_path / "cfg.yaml")


def test_data_check_drops_mixed_forms_and_blank_pairs_and_says_why(tmp_path):
    config = write_job(tmp_path, [pair(0), *MIXED, *BLANK_ANSWERS, *BLANK_PROMPTS, EMPTY_SYSTEM])
    checked = tuneforge_here("data", "check", config)
    assert checked.returncode == 0, checked.stderr
    out = checked.stdout
    assert "train: 10 records read from 1 source(s); 2 kept, 8 dropped" in out, out
    lines = {line.split(", e.g. ")[0].strip(): line for line in out.splitlines() if line.startswith("  dropped ")}
    assert set(lines) == {"dropped 3 x conflicting prompt", "dropped 2 x empty answer", "dropped 3 x empty prompt"}
    mixed = lines["dropped 3 x conflicting prompt"]
    assert "pairs.jsonl:2: `chosen` is a whole conversation with its own user message, `rejected` only an" in mixed
    assert "give both the same way" in mixed and "pairs.jsonl:4: `rejected` is a whole conversation" in mixed
    assert "pairs.jsonl:5: `chosen` is empty or only whitespace" in lines["dropped 2 x empty answer"]
    assert "pairs.jsonl:6: `rejected` is empty or only whitespace" in lines["dropped 2 x empty answer"]
    blank = lines["dropped 3 x empty prompt"]
    assert "pairs.jsonl:7: `prompt` is empty or only whitespace" in blank
    assert "pairs.jsonl:9: the shared prompt is empty or only whitespace" in blank


def test_data_preview_shows_only_the_pairs_kept_and_the_reasons_when_none_is(tmp_path):
    config = write_job(tmp_path, [*MIXED, pair(0), *BLANK_ANSWERS, EMPTY_SYSTEM])
    shown = tuneforge_here("data", "preview", config, "-n", "5")
    assert shown.returncode == 0, shown.stderr
    # Each sample's header names its row and answer (the console may wrap it between them).
    shown_rows = re.findall(r"pairs\.jsonl:(\d+)\s+\((chosen|rejected)\)", shown.stdout)
    assert shown_rows == [("4", "chosen"), ("4", "rejected"), ("7", "chosen"), ("7", "rejected")], shown.stdout
    assert "Convert #3." not in shown.stdout  # the mixed rows' questions are not trained on

    config = write_job(tmp_path, [*MIXED, *BLANK_PROMPTS])
    refused = tuneforge_here("data", "preview", config)
    assert refused.returncode == 1
    assert "6 records read from 1 source(s); 0 kept, 6 dropped" in refused.stdout
    assert "dropped 3 x conflicting prompt, e.g. " in refused.stdout and "give both the same way" in refused.stdout
    assert "dropped 3 x empty prompt, e.g. " in refused.stdout
    assert "all 6 records of" in refused.stderr
