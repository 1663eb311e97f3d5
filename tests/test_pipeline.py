"""Sources, drop accounting, the on-disk cache, validation splits, batch plans and the data CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tuneforge.config.schema import DataConfig
from tuneforge.data.batching import BatchPlanner, best_fit_decreasing, padding_fraction, plan_epoch, rows_for_rank
from tuneforge.data.pipeline import prepare_data, prepare_split
from tuneforge.data.report import format_report
from tuneforge.data.templates import get_template
from tuneforge.errors import UserError

from conftest import chat, tokenized, write_jsonl

RECORDS = [chat(f"question {i}", f"answer {i}") for i in range(6)]
TEMPLATE = get_template("deepseek_coder")


def config(tmp_path: Path, files: list[Path], **extra) -> DataConfig:
    extra.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataConfig(train_files=[str(f) for f in files], **extra)


def prepare(cfg: DataConfig, tokenizer):
    return prepare_data(cfg, tokenizer, get_template(cfg.template))


def test_jsonl_json_parquet_and_saved_datasets_read_the_same_samples(tmp_path, tokenizer):
    import datasets

    jsonl = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    array = tmp_path / "b.json"
    array.write_text(json.dumps(RECORDS))
    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_list(RECORDS).to_parquet(str(parquet))
    saved = tmp_path / "d"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(saved))
    reference = None
    for source in (jsonl, array, parquet, saved):
        data = prepare(config(tmp_path, [source], cache_dir=None), tokenizer).train.data
        assert len(data) == 6
        reference = reference if reference is not None else data
        assert np.array_equal(data.input_ids, reference.input_ids)
        assert np.array_equal(data.labels, reference.labels)
    both = prepare(config(tmp_path, [jsonl, parquet], cache_dir=None), tokenizer).train
    assert both.report.read == 12 and len(both.data) == 12
    assert both.data.origins[0] == f"{jsonl}:1" and both.data.origins[6] == f"{parquet}#row0"


def test_drops_are_counted_by_reason_with_examples(tmp_path, tokenizer):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(chat("good", "fine")),
        '{"messages": [',
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps(chat("q", "context only", loss=False)),
        json.dumps(chat("q" * 200, "too long")),
        json.dumps(chat("also good", "yes")),
    ]
    path.write_text("\n".join(lines) + "\n")
    split = prepare(config(tmp_path, [path], on_error="skip", max_length=120, cache_dir=None), tokenizer).train
    report = split.report
    assert (report.read, report.kept) == (7, 2)
    assert report.drops.counts == {
        "malformed JSON": 1,
        "unknown role": 1,
        "ends on a user turn": 1,
        "no trained tokens": 1,
        "longer than data.max_length": 1,
    }
    assert report.drops.examples["malformed JSON"][0].startswith(f"{path}:2: not valid JSON")
    assert report.drops.examples["unknown role"][0].startswith(f"{path}:3:")
    text = "\n".join(format_report(report))
    assert "dropped 1 x no trained tokens, e.g. " + f"{path}:5" in text


def test_malformed_json_stops_with_location_and_snippet_by_default(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(chat("a", "b")) + '\n{"messages": [oops]}\n')
    with pytest.raises(UserError) as info:
        prepare(config(tmp_path, [path], cache_dir=None), tokenizer)
    message = str(info.value)
    assert message.startswith(f"{path}:2: not valid JSON")
    assert '{"messages": [oops]}' in message and "data.on_error=skip" in message


def test_a_line_nested_too_deep_for_json_is_a_malformed_line_not_a_crash(tmp_path, tokenizer):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(chat("a", "b")) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(UserError, match=r"deep.jsonl:2: not valid JSON \(nested deeper than Python's JSON reader"):
        prepare(config(tmp_path, [path], cache_dir=None), tokenizer)
    report = prepare(config(tmp_path, [path], cache_dir=None, on_error="skip"), tokenizer).train.report
    assert (report.read, report.kept, report.drops.counts) == (2, 1, {"malformed JSON": 1})


def test_a_malformed_line_is_quoted_with_its_control_characters_escaped(tmp_path, tokenizer):
    path = tmp_path / "nul.jsonl"
    path.write_bytes(b'{"messages": [{"role\x00\x1b[2J": 1}]}\n')
    with pytest.raises(UserError) as info:
        prepare(config(tmp_path, [path], cache_dir=None), tokenizer)
    assert "Invalid control character at column" in str(info.value) and "at at" not in str(info.value)
    assert '{"messages": [{"role\\x00\\x1b[2J"' in str(info.value) and "\x00" not in str(info.value)


def test_unknown_format_names_the_record_and_the_fix(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "hello"}])
    with pytest.raises(UserError, match=r"x.jsonl:1: cannot tell the data format .*keys: text.*data.format"):
        prepare(config(tmp_path, [path]), tokenizer)


def test_second_run_reads_the_cache_and_a_changed_file_misses_it(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    cfg = config(tmp_path, [path])
    template = get_template(cfg.template)
    first, cached = prepare_split("train", cfg, cfg.train_files, tokenizer, template)
    assert not cached
    second, cached = prepare_split("train", cfg, cfg.train_files, tokenizer, template)
    assert cached
    assert np.array_equal(first.data.input_ids, second.data.input_ids)
    assert first.data.origins == second.data.origins
    assert second.report.kept == 6
    _, cached = prepare_split("train", cfg.model_copy(update={"max_length": 100}), cfg.train_files, tokenizer, template)
    assert not cached
    write_jsonl(path, [*RECORDS, chat("new", "sample")])
    third, cached = prepare_split("train", cfg, cfg.train_files, tokenizer, template)
    assert not cached and len(third.data) == 7


@pytest.mark.parametrize("damage", ["cut short", "header gone", "manifest gone", "same size, other tokens"])
def test_a_damaged_cache_entry_is_set_aside_and_rebuilt(tmp_path, tokenizer, capsys, damage):
    """A cache file cut short (a full disk, a copy interrupted, a user's truncate): the next run says so and
    rebuilds the entry, instead of failing on every later run with numpy's EOF errors."""
    path = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    cfg = config(tmp_path, [path])
    template = get_template(cfg.template)
    first, _ = prepare_split("train", cfg, cfg.train_files, tokenizer, template)
    (entry,) = (tmp_path / "cache").iterdir()
    if damage == "cut short":
        with (entry / "input_ids.npy").open("r+b") as handle:
            handle.truncate((entry / "input_ids.npy").stat().st_size - 8)
    elif damage == "header gone":
        (entry / "labels.npy").write_bytes(b"")
    elif damage == "manifest gone":
        (entry / "manifest.json").unlink()
    else:  # valid ids of the same byte size: only the checksum tells
        ids = np.load(entry / "input_ids.npy")
        np.save(entry / "input_ids.npy", np.full_like(ids, 100))
    again, cached = prepare_split("train", cfg, cfg.train_files, tokenizer, template)
    assert not cached and np.array_equal(again.data.input_ids, first.data.input_ids)
    err = capsys.readouterr().err
    assert f"data cache: {entry}" in err and "; rebuilding it (the damaged entry is kept as " in err
    assert prepare_split("train", cfg, cfg.train_files, tokenizer, template)[1]  # the rebuilt entry is read


def test_a_cache_hit_reports_the_files_of_the_run_that_reads_it(tmp_path, tokenizer):
    """The same file in another directory hits the cache; drops and sample origins name this run's file, not
    the one, since moved away, that filled the cache."""
    records = [*RECORDS[:3], {"messages": [{"role": "user", "content": "no reply"}]}, *RECORDS[3:]]
    (tmp_path / "old").mkdir()
    old = write_jsonl(tmp_path / "old" / "a.jsonl", records)
    cache = str(tmp_path / "cache")
    first, cached = prepare_split("train", config(tmp_path, [old], cache_dir=cache), [str(old)], tokenizer, TEMPLATE)
    assert not cached and first.report.drops.total == 1
    (tmp_path / "new").mkdir()
    new = tmp_path / "new" / "a.jsonl"
    old.rename(new)
    second, cached = prepare_split("train", config(tmp_path, [new], cache_dir=cache), [str(new)], tokenizer, TEMPLATE)
    assert cached and second.report.files == [str(new)]
    assert [o.split(":")[0] for o in second.data.origins] == [str(new)] * 6
    assert second.data.origins == [o.replace(str(old), str(new)) for o in first.data.origins]
    shown = [example for examples in second.report.drops.examples.values() for example in examples]
    assert shown and all(example.startswith(f"{new}:4") for example in shown)
    assert str(old) not in "\n".join(format_report(second.report))


def test_validation_fraction_is_held_out_with_a_fixed_seed(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", [chat(f"q{i}", f"a{i}") for i in range(20)])
    first = prepare(config(tmp_path, [path], validation_fraction=0.25), tokenizer)
    again = prepare(config(tmp_path, [path], validation_fraction=0.25), tokenizer)
    assert len(first.train.data) == 15 and len(first.validation.data) == 5
    assert first.validation.data.origins == again.validation.data.origins
    assert not set(first.validation.data.origins) & set(first.train.data.origins)
    other = prepare(config(tmp_path, [path], validation_fraction=0.25, split_seed=1), tokenizer)
    assert other.validation.data.origins != first.validation.data.origins


def test_validation_files(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "t.jsonl", RECORDS)
    valid = write_jsonl(tmp_path / "v.jsonl", RECORDS[:2])
    data = prepare(config(tmp_path, [train], validation_files=[str(valid)]), tokenizer)
    assert len(data.validation.data) == 2


def test_best_fit_decreasing_packs_every_sample_once_within_capacity():
    lengths = np.array([9, 2, 7, 3, 1, 5, 5, 8, 4])
    rows = best_fit_decreasing(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 5  # 44 tokens need at least 5 rows of 10


@pytest.mark.parametrize("strategy", ["random", "grouped", "packed"])
def test_each_epoch_covers_every_sample_once_in_a_seeded_order(strategy):
    lengths = np.random.default_rng(0).integers(5, 60, size=101)
    rows = best_fit_decreasing(lengths, 64) if strategy == "packed" else None
    plan = plan_epoch(lengths, 4, strategy, seed=3, epoch=0, packed_rows=rows)
    samples = [i for batch in plan for row in batch for i in row]
    assert sorted(samples) == list(range(101))
    assert plan == plan_epoch(lengths, 4, strategy, seed=3, epoch=0, packed_rows=rows)
    assert plan != plan_epoch(lengths, 4, strategy, seed=3, epoch=1, packed_rows=rows)


def test_grouping_and_packing_cut_padding_on_a_long_tailed_corpus():
    lengths = np.minimum(np.random.default_rng(0).lognormal(5.0, 0.8, size=2000).astype(int) + 8, 1024)
    rows = best_fit_decreasing(lengths, 1024)
    waste = {
        s: padding_fraction(plan_epoch(lengths, 8, s, 0, 0, rows), lengths) for s in ("random", "grouped", "packed")
    }
    assert waste["packed"] < waste["grouped"] < waste["random"]


def test_each_rank_gets_a_contiguous_share_and_no_rank_goes_without():
    batch = [[i] for i in range(8)]
    shares = [rows_for_rank(batch, rank, 4, filler=[[100]]) for rank in range(4)]
    assert shares == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    uneven = [rows_for_rank(batch[:5], rank, 4, filler=[[100]]) for rank in range(4)]
    assert [row for share in uneven for row in share] == batch[:5] and all(uneven)
    short = [rows_for_rank(batch[:2], rank, 4, filler=[[100], [101]]) for rank in range(4)]
    assert short == [[[0]], [[1]], [[100]], [[101]]]  # topped up by repeating rows, never dropped


@pytest.mark.parametrize("strategy", ["grouped", "random"])
def test_every_sample_trains_once_per_epoch_on_any_number_of_ranks(tokenizer, strategy):
    """13 samples over 4 ranks, one row each: the last global batch has 1 row, and 3 ranks get a repeated row to
    stay in step. Those rows train nothing (their targets masked) and count in no batch's totals, so the target
    tokens trained in an epoch are the data's, as in one process."""
    data = tokenized(tokenizer, [chat(f"q{i}" * (i % 5 + 1), f"a{i}") for i in range(13)])
    planners = [
        BatchPlanner(data, 1, 0, seed=1, strategy=strategy, max_length=1024, rank=r, world_size=4) for r in range(4)
    ]
    epochs = [list(planner.epoch(0)) for planner in planners]
    trained = sum(batch.num_targets for batches in epochs for batch in batches)
    assert trained == sum(int(data.target_counts()[i]) for i in range(len(data)))
    for step in range(len(epochs[0])):
        batches = [batches[step] for batches in epochs]
        assert {b.global_targets for b in batches} == {sum(b.num_targets for b in batches)}
    short = [step for step, batch in enumerate(epochs[0]) if batch.global_samples == 1]
    assert len(short) == 1
    assert [batches[short[0]].num_targets > 0 for batches in epochs] == [True, False, False, False]


def test_planners_of_two_ranks_see_the_global_batches_of_one(tokenizer):
    # 14 samples: the last global micro-batch has 2 rows, one per rank, so nothing needs repeating.
    data = tokenized(tokenizer, [chat(f"q{i}" * (i % 5 + 1), f"a{i}") for i in range(14)])
    one = BatchPlanner(data, 4, 0, seed=1, strategy="grouped", max_length=1024)
    ranks = [
        BatchPlanner(data, 2, 0, seed=1, strategy="grouped", max_length=1024, rank=r, world_size=2) for r in (0, 1)
    ]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == 4
    for whole, first, second in zip(one.plan(0), ranks[0].plan(0), ranks[1].plan(0), strict=True):
        assert whole == first + second


@pytest.mark.parametrize("strategy", ["grouped", "packed"])
def test_every_rank_knows_the_global_target_count_of_each_micro_batch_from_the_plan(tokenizer, strategy):
    """The step's divisor without a collective: each rank's micro-batch carries the target count of the whole
    global micro-batch, which equals the sum of every rank's own count (rows repeated to fill a batch included),
    and one process's count of the same global batch."""
    data = tokenized(tokenizer, [chat(f"q{i}" * (i % 5 + 1), f"a{i}" * (i % 3 + 1)) for i in range(11)])
    one = BatchPlanner(data, 6, 0, seed=1, strategy=strategy, max_length=64)
    ranks = [BatchPlanner(data, 2, 0, seed=1, strategy=strategy, max_length=64, rank=r, world_size=3) for r in range(3)]
    batches = list(zip(one.epoch(0), *(r.epoch(0) for r in ranks), strict=True))
    assert batches
    for whole, *shares in batches:
        assert {share.global_targets for share in shares} == {sum(share.num_targets for share in shares)}
        if whole.input_ids.size(0) >= len(shares):  # no row repeated to fill a rank's share
            assert shares[0].global_targets == whole.num_targets == whole.global_targets
    assert data.target_counts().sum() == sum(int((data.sample(i)[1][1:] != -100).sum()) for i in range(len(data)))


def test_data_check_and_preview_through_the_cli(tmp_path, capsys):
    from tuneforge.cli import main

    path = write_jsonl(tmp_path / "d.jsonl", [chat("Convert #000000 to RGB.", "(0, 0, 0)"), {"messages": []}])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model: {{architecture: llama, tokenizer: bytes}}\ndata: {{train_files: [{path}], cache_dir: null}}\n"
    )
    assert main(["data", "check", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "2 records read from 1 source(s); 1 kept, 1 dropped" in out
    assert f"dropped 1 x empty conversation, e.g. {path}:2" in out
    assert main(["data", "preview", str(cfg), "-n", "1"]) == 0
    assert "[[(0, 0, 0)</s>]]" in capsys.readouterr().out
    assert main(["data", "check", str(cfg), "data.max_length=5"]) == 1
    err = capsys.readouterr().err
    assert f"error: data: all 2 records of {path} were dropped, for the reasons listed above" in err


def test_tokenized_helper_matches_pipeline(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    data = prepare(config(tmp_path, [path], cache_dir=None), tokenizer).train.data
    assert np.array_equal(data.input_ids, tokenized(tokenizer, RECORDS).input_ids)


def test_other_ranks_wait_for_rank_zero_then_read_its_cache(tmp_path, tokenizer, monkeypatch):
    import threading

    from tuneforge.data import pipeline

    path = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    cfg = config(tmp_path, [path])
    template = get_template(cfg.template)
    results = {}
    waiting = threading.Event()
    wait_for = pipeline._wait_for

    def noted_wait(*args, **kwargs):
        waiting.set()
        return wait_for(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_wait_for", noted_wait)
    waiter = threading.Thread(
        target=lambda: results.update(rank1=prepare_split("train", cfg, cfg.train_files, tokenizer, template, 1, 2))
    )
    waiter.start()
    assert waiting.wait(timeout=30)  # rank 1 waits for rank 0's cache rather than building the data itself
    assert waiter.is_alive() and "rank1" not in results
    built, cached = prepare_split("train", cfg, cfg.train_files, tokenizer, template, 0, 2)
    waiter.join(timeout=30)
    assert not cached
    loaded, loaded_from_cache = results["rank1"]
    assert loaded_from_cache and np.array_equal(loaded.data.input_ids, built.data.input_ids)


def test_a_waiting_rank_gives_up_with_its_own_timeout(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    cfg = config(tmp_path, [path], preprocess_timeout_s=0.5)
    with pytest.raises(
        UserError,
        match=r"local rank 1: this node's local rank 0 did not finish preprocessing .* within 0.5s "
        r"\(data.preprocess_timeout_s\)",
    ):
        prepare_split("train", cfg, cfg.train_files, tokenizer, get_template(cfg.template), 1, 2)


def test_data_commands_check_their_inputs_as_train_does(tmp_path, capsys):
    """A missing data file, a tokenizer that is not there, a cache dir that is a file, a max_length beyond the
    model's context: one line each, no traceback."""
    from tuneforge.cli import main

    (tmp_path / "a-file").write_text("")
    (tmp_path / "cfg.yaml").write_text(
        "model: {architecture: llama, tokenizer: ./no-tokenizer, size: {max_position_embeddings: 64}}\n"
        f"data: {{train_files: [missing.jsonl], cache_dir: {tmp_path / 'a-file'}, max_length: 128}}\n"
    )
    for command in ("check", "preview"):
        assert main(["data", command, str(tmp_path / "cfg.yaml")]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[0] == f"error: data.train_files: {tmp_path / 'missing.jsonl'} not found (relative paths are " + (
            "read from the config file's directory)"
        )
        assert err[1].startswith("model.tokenizer: ./no-tokenizer")
        assert err[2] == f"data.cache_dir {tmp_path / 'a-file'}: {tmp_path / 'a-file'} is a file, not a directory; " + (
            "choose another path"
        )
        assert err[3].startswith("data.max_length: 128 is beyond the model's context (64 positions")


def test_a_pipe_as_train_file_and_a_deepspeed_json_that_is_not_json_are_said_before_anything_runs(tmp_path):
    import os

    from tuneforge.config import load_config
    from tuneforge.train.inputs import check_inputs

    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2,}')
    (tmp_path / "cfg.yaml").write_text(
        "model: {architecture: llama, tokenizer: bytes}\n"
        "data: {train_files: [pipe.jsonl]}\n"
        f"parallel: {{engine: deepspeed, deepspeed_config: {tmp_path / 'ds.json'}}}\n"
    )
    with pytest.raises(UserError) as info:
        check_inputs(load_config(tmp_path / "cfg.yaml"), tmp_path / "run")
    lines = str(info.value).splitlines()
    assert lines[0] == f"data.train_files: {tmp_path / 'pipe.jsonl'} is not a regular file (a pipe such as " + (
        "`<(...)`, or a device): the data is read more than once; write it to a file"
    )
    assert lines[1].startswith(f"parallel.deepspeed_config: cannot read {tmp_path / 'ds.json'} (Expecting")

    # A shell's process substitution, `<(...)`: /dev/fd/N links to `pipe:[...]`, which is no path; it is named
    # as given, not reported missing.
    read_end, write_end = os.pipe()
    try:
        cfg = load_config(tmp_path / "cfg.yaml", [f"data.train_files=[/dev/fd/{read_end}]"])
        with pytest.raises(UserError, match=rf"^data.train_files: /dev/fd/{read_end} is not a regular file \(a pipe"):
            check_inputs(cfg, tmp_path / "run")
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_tokenizer_template_that_cannot_render_is_one_error(tokenizer):
    import copy

    from tuneforge.data.conversation import prompt_conversation
    from tuneforge.data.templates import TokenizerTemplate

    broken = copy.deepcopy(tokenizer)
    broken.chat_template = "{% for m in messages %}{{ m['content'] }}"
    with pytest.raises(UserError, match=r"the tokenizer's chat_template cannot be rendered \(TemplateSyntaxError"):
        TokenizerTemplate()._apply(broken, prompt_conversation([], "hi").messages(), generation_prompt=True)


def test_a_file_mixing_formats_says_its_first_record_decided(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"instruction": "x", "output": "y"}, *RECORDS])
    report = prepare(config(tmp_path, [path], cache_dir=None, on_error="skip"), tokenizer).train.report
    assert report.drops.counts == {"another format than the file's first record": 6}
    assert report.drops.examples["another format than the file's first record"][0] == (
        f"{path}:2: looks like openai, but {path}:1 made the file alpaca; give each format its own file, or set "
        "data.format"
    )


@pytest.mark.parametrize("truncation", ["drop", "truncate"])
def test_a_sample_too_long_for_any_tokenizer_is_dropped_without_tokenizing(tmp_path, tokenizer, truncation):
    """20 million characters against max_length 64: the report says so in well under a second (it took minutes
    and gigabytes to tokenize first); the other samples are kept as before."""
    import time

    path = write_jsonl(tmp_path / "huge.jsonl", [chat("x" * 20_000_000, "y"), *RECORDS])
    started = time.monotonic()
    report = prepare(config(tmp_path, [path], cache_dir=None, max_length=64, truncation=truncation), tokenizer)
    report = report.train.report
    assert time.monotonic() - started < 5
    assert report.kept == len(RECORDS) and report.drops.counts == {"longer than data.max_length": 1}
    assert report.drops.examples["longer than data.max_length"] == [f"{path}:1 (20,000,001 characters, not tokenized)"]


def test_a_data_file_this_user_may_not_read_is_said_before_anything_runs(tmp_path, monkeypatch):
    """`chmod 000` on a data file (or on one file of a data directory): one line naming it and the fix, where the
    cache's fingerprint or the reader raised a PermissionError traceback. Root reads anything, so this user's
    access is what is asked (here made to say no for that file)."""
    import os

    from tuneforge.config import load_config
    from tuneforge.train.inputs import check_inputs

    write_jsonl(tmp_path / "a.jsonl", RECORDS)
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "b.jsonl", RECORDS)
    (tmp_path / "cfg.yaml").write_text(
        "model: {architecture: llama, tokenizer: bytes}\ndata: {train_files: [a.jsonl, shards]}\n"
    )
    real = os.access
    locked = {str(tmp_path / "a.jsonl"), str(tmp_path / "shards" / "b.jsonl")}
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) not in locked and real(path, mode))
    with pytest.raises(UserError) as info:
        check_inputs(load_config(tmp_path / "cfg.yaml"), tmp_path / "run")
    assert str(info.value).splitlines() == [
        f"data.train_files: {tmp_path / 'a.jsonl'} cannot be read by this user; fix its permissions (chmod a+r)",
        f"data.train_files: {tmp_path / 'shards' / 'b.jsonl'} cannot be read by this user; fix its permissions "
        "(chmod a+r)",
    ]
