"""One rule for a line of a run's logs, applied by every reader: resume's cut-back, `plot` and `watch` keep and
count the same lines of the same file."""

from __future__ import annotations

import json

from tuneforge.run_files import RunFiles, read_step_log, step_record
from tuneforge.train.plot import read_metrics
from tuneforge.train.resume import truncate_log
from tuneforge.watch import read_run

LINES = [
    json.dumps({"step": 1, "loss": 2.0, "lr": 1e-3}),
    '{"step": 2, "loss": 1.9',  # cut off by a crash
    json.dumps({"step": "3", "loss": 1.8}),  # a step of another type
    json.dumps([1, 2]),
    "",
    json.dumps({"step": 4, "loss": 1.7, "lr": 1e-3}),
    "[" * 100_000,  # nested past the parser
    json.dumps({"step": True, "loss": 1.0}),
    json.dumps({"step": 2**60, "loss": 1.0}),  # no step a run logged
]


def test_every_reader_keeps_and_counts_the_same_lines(tmp_path):
    files = RunFiles(tmp_path)
    files.metrics.write_bytes(("\n".join(LINES) + "\n").encode() + b'{"step": 5, "loss": 1.6, "x": "\xff"}\n')
    kept = [record["step"] for record in read_step_log(files.metrics).records]
    assert kept == [1, 4, 5]
    assert read_step_log(files.metrics).unreadable == [2, 3, 4, 7, 8, 9]
    assert [r["step"] for r in read_metrics(files.metrics).records] == kept
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x", "started": 0}))
    view = read_run(tmp_path)
    assert view.progress.last is not None and view.progress.last.step == 5
    assert view.progress.left_out == 6
    assert truncate_log(files.metrics, 4) == 6  # the same six dropped; step 5 is past the resume point
    assert [json.loads(line)["step"] for line in files.metrics.read_text().splitlines()] == [1, 4]


def test_a_step_record_is_a_json_object_with_an_integer_step():
    assert step_record(b'{"step": 0}') == {"step": 0}
    assert step_record('{"step": 3, "loss": null}') == {"step": 3, "loss": None}
    for line in ('{"step": -1}', '{"step": 1.0}', '{"loss": 1}', "null", "not json", b"\xff\xfe"):
        assert step_record(line) is None, line
