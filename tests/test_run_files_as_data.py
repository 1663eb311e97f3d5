"""Whatever a run's files hold reaches the watcher's terminal as text: `tuneforge watch`, `diagnose` and `plot`
fed terminal escape sequences, rich markup and fields of the wrong type print them escaped, or name the file
in one line, never acting on them and never with a traceback (anyone who can write into a shared work dir
writes these files)."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuneforge.cli import main
from tuneforge.diagnose import live_dump
from tuneforge.terminal import safe_text

ESCAPES = {
    "clipboard": "\x1b]52;c;aGVsbG8=\x07",
    "title": "\x1b]0;pwned\x1b\\",
    "clear": "\x1b[2J",
    "link": "\x1b]8;;file:///etc/passwd\x1b\\",
    "c1": "\x9b2J",
}
RAW = ("\x1b", "\x9b", "\x07")
"""With a console without colour, no byte of these may reach the output: each comes from a file."""
SEQUENCES = ("\x1b]52", "\x1b]0;", "\x1b[2J", "\x1b]8;", "\x9b")
"""On a terminal rich writes its own styles (`ESC [1m`), never one of these."""
MARKUP = ("[link=file:///etc/passwd]x[/link]", "[/INST]", "[bold]")


def no_raw_control(text: str) -> bool:
    return not any(code in text for code in RAW)


@pytest.fixture(autouse=True)
def plain_wide_console(monkeypatch):
    """rich writes no styles of its own (not a terminal, colour not forced), on lines wide enough for a row."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.setenv("COLUMNS", "250")


def test_safe_text_makes_control_characters_visible_and_keeps_newlines_tabs_and_text():
    assert safe_text("a\x1b]0;t\x07b\x9b2J\x7f\r") == "a\\x1b]0;t\\x07b\\x9b2J\\x7f\\x0d"
    assert safe_text("line\n\tnext [/INST] é ✓") == "line\n\tnext [/INST] é ✓"
    assert safe_text(json.loads('"\\ud800"')) == "\\ud800"  # a lone surrogate cannot be printed
    assert safe_text(5) == "5" and safe_text(None) == "None" and safe_text(["\x1b"]) == "['\\x1b']"


def hostile_run(root: Path) -> Path:
    """A work dir whose every file shows escape sequences, markup and fields of the wrong type."""
    run = root / "run"
    live = run / "diagnostics" / "live"
    live.mkdir(parents=True)
    now = time.time()
    (run / "run.json").write_text(json.dumps({"run_id": ESCAPES["title"], "started": "[bold]"}))
    beats = [
        {"rank": 0, "host": ESCAPES["title"] + MARKUP[0], "phase": ESCAPES["clipboard"] + MARKUP[1]},
        {"rank": "[bold]1", "host": 5, "phase": ESCAPES["clear"] + ESCAPES["c1"], "step": "x", "total_steps": [9]},
        {"rank": None, "host": ESCAPES["link"], "phase": None, "micro_steps": "2", "micro_step": {}},
    ]
    for index, beat in enumerate(beats):
        beat = {"step": 3, "total_steps": 9, "updated": now, "limit_s": 30, **beat}
        (live / f"rank-{index}.json").write_text(json.dumps(beat))
    (live / "rank-3.json").write_text(json.dumps({"rank": 3, "updated": now, "limit_s": "a", "host": "h"}))
    (live / f"rank-{ESCAPES['title']}.json").write_text("[1]")  # its name is shown among those left out
    rows = [
        {"step": 1, "loss": 2.5, "lr": "\x1b[2J", "tokens_per_s": "[bold]", "peak_memory_gb": [1], "elapsed_s": "x"},
        {"step": "x", "loss": 1.0},
        {"step": 2, "loss": [1]},
        {"step": 3, "loss": 2.0, "lr": 1e-3, "val_loss": {"a": ESCAPES["clear"]}, "elapsed_s": 1e999},
    ]
    lines = [json.dumps(row).encode() for row in rows] + [b'{"step": 4, "loss": 1.5, "lr": "\xff\xfe"}', b"[" * 100_000]
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    chats = [
        {"step": 7, "prompt": MARKUP[0] + ESCAPES["clipboard"], "reply": "a [/INST] b " + ESCAPES["clear"]},
        {"step": 7, "prompt": 5, "reply": None},
        {"step": "[bold]7", "prompt": "a step of another type: no sample record"},
        "just a string",
    ]
    (run / "samples.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    report = "tuneforge diagnosis: HANG (mismatch)\n" + " ".join(ESCAPES.values()) + "\n" + " ".join(MARKUP) + "\n"
    (run / "diagnostics" / "report.txt").write_bytes(report.encode() + b"bad byte: \xff\n")
    return run


def test_watch_shows_escape_sequences_markup_and_wrong_types_from_every_run_file_as_text(tmp_path, capsys):
    run = hostile_run(tmp_path)
    assert main(["watch", str(run), "--once"]) == 3  # the diagnosis is there
    out, err = capsys.readouterr()
    assert err == "" and no_raw_control(out), out
    for markup in MARKUP:
        assert markup in out  # shown, not acted on
    assert "\\x1b]52;c;aGVsbG8=\\x07" in out and "\\x1b]0;pwned\\x1b\\" in out and "\\x9b2J" in out
    assert "'a [/INST] b \\x1b[2J'" in out and "sample chat at step 7" in out and "5 -> None" in out
    assert "bad byte: \ufffd" in out and "tuneforge diagnosis: HANG (mismatch)" in out
    rows = [line.split("│")[1:4] for line in out.splitlines() if line.startswith("│ ") and "running" in line]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["0", "\\x1b]0;pwned\\x1b\\[link=file:///etc/passwd]x[/link]", "\\x1b]52;c;aGVsbG8=\\x07[/INST]"],
        ["?", "\\x1b]8;;file:///etc/passwd\\x1b\\", ""],
        ["[bold]1", "5", "\\x1b[2J\\x9b2J"],
    ]
    # Rows without an integer step and a numeric loss are counted; the others show what is a number.
    assert "loss 1.5000" in out and "lr   ?" in out and "step 4/9\n" in out and "val_loss" not in out
    assert "left out: 3 line(s) of metrics.jsonl that are no step record; 2 line(s) of samples.jsonl" in out
    assert "2 file(s) in diagnostics/live that are no heartbeat (rank-\\x1b]0;pwned\\x1b\\.json, rank-3.json)" in out

    (run / "diagnostics" / "report.txt").unlink()  # the same view without a diagnosis
    assert main(["watch", str(run), "--once"]) == 0
    out = capsys.readouterr().out
    assert no_raw_control(out) and "[/INST]" in out and "diagnosis" not in out


def dump_dir(root: Path, **fields) -> Path:
    """A 2-rank run that stalled: rank 0's dump and both heartbeats, on another host (no process is asked)."""
    run = root / "dumped"
    live = run / "diagnostics" / "live"
    live.mkdir(parents=True)
    text = ESCAPES["clipboard"] + MARKUP[0] + ESCAPES["clear"]
    beat = {"world_size": 2, "phase": text, "step": 3, "updated": time.time() - 100, "limit_s": 30,
            "host": "elsewhere", "pid": 1, "module": text}  # fmt: skip
    dump = {**beat, "rank": 0, "reason": "stall", "where": text, "detail": text, "in_flight": text, "collectives": []}
    (run / "diagnostics" / "rank-0.json").write_text(json.dumps({**dump, **fields}))
    for rank in (0, 1):
        (live / f"rank-{rank}.json").write_text(json.dumps({**beat, "rank": rank}))
    return run


def test_diagnose_prints_a_report_and_the_dumps_it_builds_one_from_as_text(tmp_path, capsys):
    run = hostile_run(tmp_path)
    assert main(["diagnose", str(run)]) == 0
    out = capsys.readouterr().out
    assert no_raw_control(out) and "[/INST]" in out and "\\x1b]52;c;aGVsbG8=\\x07" in out
    assert "bad byte: \ufffd" in out

    assert main(["diagnose", str(dump_dir(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tuneforge diagnosis: HANG (frozen)") and no_raw_control(out)
    assert "phase \\x1b]52;c;aGVsbG8=\\x07[link=file:///etc/passwd]x[/link]\\x1b[2J, step 3" in out


WRONG = {
    "a step as text": ("dump", {"step": "3"}),
    "a detail as a number": ("dump", {"detail": 5}),
    "a collective without a number": ("dump", {"collectives": [{"seq": "x", "op": "all_reduce"}]}),
    "collectives as text": ("dump", {"collectives": "\x1b[2J"}),
    "an update time as text": ("beat", {"updated": "\x1b]0;x\x07"}),
    "a pid no process has": ("beat", {"pid": 10**30}),
    "a world of a billion ranks": ("beat", {"world_size": 10**9}),
    "a heartbeat that is a list": ("beat", [1, 2]),
    "JSON nested past the parser": ("beat", "[" * 100_000),
}


@pytest.mark.parametrize("case", WRONG)
def test_diagnose_names_a_field_of_the_wrong_type_in_one_line(tmp_path, capsys, case):
    which, value = WRONG[case]
    run = dump_dir(tmp_path, **(value if which == "dump" else {}))
    if which == "beat":
        path = run / "diagnostics" / "live" / "rank-1.json"
        if isinstance(value, dict):
            value = {**json.loads(path.read_text()), **value}
        path.write_text(value if isinstance(value, str) else json.dumps(value))
    assert main(["diagnose", str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and no_raw_control(err), err
    assert "rank-" in err and "move it away and diagnose again" in err


def test_a_live_dump_prints_what_each_rank_answered_as_text(tmp_path, capsys):
    run = dump_dir(tmp_path)
    diagnostics = run / "diagnostics"
    text = ESCAPES["title"] + MARKUP[1]
    answer = {"phase": text, "step": "[bold]", "module": None, "where": text + "\nrank 9: forged", "in_flight": text,
              "idle_s": "x"}  # fmt: skip
    (diagnostics / "live-0.json").write_text(json.dumps(answer))
    for rank in (0, 1):  # both answered (after the request this dump writes)
        mark = diagnostics / "live" / f"answered-rank-{rank}"
        mark.write_text("")
        os.utime(mark, (time.time() + 3600, time.time() + 3600))
    assert main(["diagnose", "--live", str(run)]) == 0
    out = capsys.readouterr().out
    assert no_raw_control(out) and "(2/2 ranks answered)" in out
    assert "rank 0: phase \\x1b]0;pwned\\x1b\\[/INST], step [bold], module -, at " in out and "idle ?" in out
    assert "\\nrank 9: forged" in out  # a line break in a field does not start a line of its own
    assert "rank 1: no answer (last heartbeat: " in out
    assert no_raw_control(live_dump(run, timeout_s=0.1))


def test_plot_leaves_out_and_counts_lines_of_any_other_type_or_encoding(tmp_path, capsys):
    run = tmp_path / "a $run"  # a `$` in the title would start matplotlib's math text
    run.mkdir()
    lines = [
        b'{"step": 1, "loss": 2.0, "lr": 0.001}',
        b'{"step": 2, "loss": "\\u001b]52;c;aGk=\\u0007", "lr": "[bold]", "val_loss": [1]}',
        b'{"step": 3, "loss": ' + b"9" * 400 + b', "skipped": "\\u001b[2J"}',
        b'{"step": "x", "loss": 1.0}',
        b'{"step": 100000000000000000000000000000, "loss": 1.0}',
        b'{"step": 4, "loss": 1.0, "lr": "\xff\xfe"}',
        b"\xff\xfe",
        b"[" * 100_000,
    ]
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert main(["plot", str(run)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(run / "plot.png") and (run / "plot.png").stat().st_size > 0
    assert "4 unreadable line(s) left out of the plot (line 4, 5, 7, 8)" in err and no_raw_control(out + err)


def test_a_plot_that_fails_at_the_end_of_training_says_why_as_text(tmp_path, monkeypatch, capsys):
    from tuneforge.train import plot

    def fails(work_dir: Path) -> Path:
        raise ValueError(f"cannot draw {ESCAPES['title']}[/INST]")

    monkeypatch.setattr(plot, "plot_metrics", fails)
    assert plot.plot_at_end(tmp_path) is None
    err = capsys.readouterr().err
    assert "plot not written (ValueError: cannot draw \\x1b]0;pwned\\x1b\\[/INST])" in err and no_raw_control(err)


def run_in_a_terminal(*argv: str, timeout: float = 60) -> tuple[int, str]:
    """`python -m tuneforge ARGV...` with a pseudo-terminal for its input and output, as a user runs it; its
    exit status and all it wrote."""
    primary, secondary = pty.openpty()
    env = {key: value for key, value in os.environ.items() if key not in ("NO_COLOR", "FORCE_COLOR")}
    env.update(TERM="xterm-256color", COLUMNS="250", LINES="60")
    process = subprocess.Popen([sys.executable, "-m", "tuneforge", *argv], stdin=secondary, stdout=secondary,
                               stderr=secondary, env=env, close_fds=True)  # fmt: skip
    os.close(secondary)
    written = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the process closed its terminal
                break
            if not chunk:
                break
            written += chunk
        status = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.kill()
        os.close(primary)
    return status, written.decode("utf-8", errors="replace")


def escapes_run(root: Path) -> Path:
    """A work dir whose files are well formed, but whose every shown text is an escape sequence or a link."""
    run = root / "escapes"
    live = run / "diagnostics" / "live"
    live.mkdir(parents=True)
    beat = {"rank": 0, "host": f"{ESCAPES['title']} {MARKUP[0]}", "phase": ESCAPES["clipboard"] + ESCAPES["clear"],
            "step": 3, "total_steps": 9, "updated": time.time(), "limit_s": 30}  # fmt: skip
    (live / "rank-0.json").write_text(json.dumps(beat))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    chat = {"step": 1, "prompt": ESCAPES["link"] + ESCAPES["c1"], "reply": MARKUP[0]}
    (run / "samples.jsonl").write_text(json.dumps(chat) + "\n")
    (run / "diagnostics" / "report.txt").write_text("".join(ESCAPES.values()) + MARKUP[0] + "\n")
    return run


@pytest.mark.slow
@pytest.mark.parametrize("files", ["escapes only", "escapes, markup and wrong types"])
def test_watch_once_in_a_terminal_acts_on_nothing_a_run_file_holds(tmp_path, files):
    run = escapes_run(tmp_path) if files == "escapes only" else hostile_run(tmp_path)
    status, out = run_in_a_terminal("watch", "--once", str(run))
    assert status == 3 and "Traceback" not in out, out[-3000:]
    assert "\x1b[1m" in out  # a terminal: rich styled its own text
    assert not any(sequence in out for sequence in SEQUENCES), [s for s in SEQUENCES if s in out]
    assert MARKUP[0] in out and "\\x1b]0;pwned\\x1b\\" in out and "\\x9b2J" in out


HOSTILE = "".join(ESCAPES.values()) + "\u202e"


def test_data_preview_and_a_user_error_show_a_datasets_bytes_as_text(tmp_path, capsys):
    """A dataset's text, its file's name and an error quoting them: shown, never acted on by the terminal."""
    from conftest import TINY_LLAMA, chat, tuneforge_here, write_jsonl

    folder = tmp_path / f"data{ESCAPES['title']}"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [chat(f"question {HOSTILE}", f"answer {HOSTILE}")])
    config = tmp_path / "cfg.yaml"
    config.write_text(TINY_LLAMA + f"data: {{train_files: [{json.dumps(str(folder / 'train.jsonl'))}]}}\n")
    shown = tuneforge_here("data", "preview", str(config))
    assert shown.returncode == 0, shown.stderr
    assert no_raw_control(shown.stdout) and "\\x1b]52;c;aGVsbG8=\\x07" in shown.stdout
    assert "\\u202e" in shown.stdout and "\u202e" not in shown.stdout
    (folder / "train.jsonl").unlink()
    missing = tuneforge_here("data", "check", str(config))
    assert missing.returncode == 2 and "not found" in missing.stderr
    assert no_raw_control(missing.stderr) and "data\\x1b]0;pwned\\x1b\\" in missing.stderr


def test_a_chat_reply_streams_as_text(capsys):
    from tuneforge.chat import SafeStreamer

    class Tokenizer:  # decodes what generate hands the streamer, as a tokenizer would
        def decode(self, ids, **_):
            return "".join(HOSTILE if i == 1 else "ok " for i in ids)

    streamer = SafeStreamer(Tokenizer())
    streamer.put(__import__("torch").tensor([[0, 1, 0]]))
    streamer.end()
    out = capsys.readouterr().out
    assert no_raw_control(out) and "ok \\x1b]52;c;aGVsbG8=\\x07" in out


def test_the_report_a_rank_prints_quotes_the_other_ranks_files_as_text(tmp_path):
    from tuneforge.diagnostics.report import build_report

    report = build_report(dump_dir(tmp_path) / "diagnostics", 2)
    assert report.startswith("tuneforge diagnosis:") and no_raw_control(report)
    assert "\\x1b]52;c;aGVsbG8=\\x07" in report
