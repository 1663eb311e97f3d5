"""The post-mortem's reading of per-rank collective records, on records written by hand."""

from __future__ import annotations

import os

from tuneforge.diagnostics.report import diagnose


def gather(seq: int, module: str) -> dict:
    return {
        "seq": seq,
        "op": "all_gather_into_tensor",
        "shapes": [[2048], [1024]],
        "dtypes": ["float32"] * 2,
        "module": module,
        "phase": "forward/backward",
    }


def state(rank: int, collectives: list[dict], **extra) -> dict:
    return {"rank": rank, "phase": "forward/backward", "step": 1, "collectives": collectives, **extra}


def test_same_sized_gathers_of_different_experts_are_named_as_the_moe_cause():
    """Expert parameters of equal size pair up in every collective, so the ranks run on until DeepSpeed's own
    trace check fails on one of them; the report must still name the experts where the ranks parted."""
    shared = [gather(1, "layers.0.attn"), gather(2, "layers.0.moe.gate")]
    rank0 = state(0, [*shared, gather(3, "layers.0.moe.experts.7.up"), gather(4, "layers.1.attn")], reason="error")
    rank1 = state(
        1,
        [*shared, gather(3, "layers.0.moe.experts.8.up"), gather(4, "layers.1.attn")],
        reason="error",
        detail="RuntimeError: Detected a disagreement on list contents between rank0 and rank1",
    )
    found = diagnose({0: rank0, 1: rank1}, {})
    assert found.cause.key == "moe" and found.diverged == []
    assert any("#3" in line for line in found.detail)
    assert any("rank 0:" in line and "experts.7.up" in line for line in found.detail)
    assert any("rank 1:" in line and "experts.8.up" in line for line in found.detail)


def test_different_modules_outside_experts_are_not_taken_for_moe():
    rank0 = state(0, [gather(1, "layers.0.attn"), gather(2, "layers.0.mlp")], reason="error")
    rank1 = state(1, [gather(1, "layers.0.attn"), gather(2, "layers.1.mlp")], reason="error")
    assert diagnose({0: rank0, 1: rank1}, {}).cause.key != "moe"


def test_a_mismatch_far_from_the_experts_is_still_put_down_to_per_expert_collectives():
    """Under DeepSpeed the ranks can agree on every expert gather and part later (its prefetching follows one
    step's routing); the records' per-expert collectives are then the evidence."""
    shared = [gather(1, "layers.0.moe.experts.3.up"), gather(2, "layers.0.mix")]
    scatter = {**gather(3, "embed"), "op": "reduce_scatter_tensor", "shapes": [[61184], [122368]]}
    rank0 = state(0, [*shared, gather(3, "layers.1.mix")], reason="stall")
    rank1 = state(1, [*shared, scatter], reason="stall")
    found = diagnose({0: rank0, 1: rank1}, {})
    assert found.cause.key == "moe"
    assert any("experts.3.up" in line for line in found.detail)


def test_a_mismatch_without_expert_collectives_stays_a_mismatch():
    scatter = {**gather(2, "embed"), "op": "reduce_scatter_tensor", "shapes": [[61184], [122368]]}
    rank0 = state(0, [gather(1, "layers.0.mix"), gather(2, "layers.1.mix")], reason="stall")
    rank1 = state(1, [gather(1, "layers.0.mix"), scatter], reason="stall")
    assert diagnose({0: rank0, 1: rank1}, {}).cause.key == "mismatch"


FATAL = """Fatal Python error: Aborted

Thread 0x00007fb9fa4a76c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007fb9fc91e740 (most recent call first):
  File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 2951 in all_reduce
  File "/venv/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/src/tuneforge/diagnostics/recorder.py", line 221 in recorded
  File "/work/my_model/modeling_mine.py", line 57 in forward
  File "/venv/site-packages/torch/nn/modules/module.py", line 1786 in _call_impl

Extension modules: numpy.core._multiarray_umath (total: 1)
"""


def test_a_rank_that_aborted_in_a_collective_is_read_from_its_faulthandler_stacks(tmp_path):
    from tuneforge.diagnostics.report import read_fatal_signal

    (tmp_path / "fatal-rank-0.txt").write_text(FATAL)
    fatal = read_fatal_signal(tmp_path / "fatal-rank-0.txt")
    assert fatal is not None
    assert fatal.error == "Fatal Python error: Aborted"
    assert fatal.site == "/work/my_model/modeling_mine.py:57 in forward"
    (tmp_path / "fatal-rank-1.txt").write_text("")
    assert read_fatal_signal(tmp_path / "fatal-rank-1.txt") is None


def test_an_abort_is_a_consequence_a_sigkill_is_the_cause():
    """A dead rank's heartbeat lags: its collective #2 was never published, #3 came from its black box. The
    unseen #2 is not taken for a skipped collective; #3 is where the ranks part."""
    extra = {**gather(3, "layers.0.mix"), "op": "all_reduce", "shapes": [[1]], "site": "/m/model.py:57 in forward"}
    rank0 = state(0, [gather(1, "layers.0.attn"), extra])
    rank1 = state(
        1, [gather(1, "layers.0.attn"), gather(2, "layers.0.mix"), gather(3, "layers.1.attn")], reason="error"
    )
    aborted = diagnose({0: rank0, 1: rank1}, {0: "died of SIGABRT"})
    assert aborted.cause.key == "mismatch" and aborted.diverged == [0]
    assert "first disagreement at collective #3:" in aborted.detail
    assert any(
        "rank 0 issued all_reduce #3 from /m/model.py:57 in forward, a line no other" in d for d in aborted.detail
    )
    killed = diagnose({0: rank0, 1: rank1}, {0: "killed by SIGKILL"})
    assert killed.cause.key == "killed" and killed.diverged == [0]


def test_an_abort_whose_heartbeat_ends_before_the_ranks_part_still_names_the_experts():
    """A rank that aborted published its collectives up to its last heartbeat, here before anything differs;
    the survivor's record shows collectives issued inside the experts: the MoE cause, the abort its
    consequence (the legacy-MoE hang under ZeRO-3 without leaf modules, as gloo ends it)."""
    shared = [gather(1, "layers.0.attn"), gather(2, "layers.0.moe.gate")]
    rank0 = state(0, shared)  # a heartbeat: no "reason"
    rank1 = state(1, [*shared, gather(3, "layers.0.moe.experts.3.up"), gather(4, "layers.1.attn")], reason="error")
    found = diagnose({0: rank0, 1: rank1}, {0: "died of SIGABRT"})
    assert found.cause.key == "moe"
    assert any("experts.3.up" in line and "collectives of their own" in line for line in found.detail)
    assert any(line.startswith("rank 0 died of SIGABRT (a consequence") for line in found.detail)
    without_experts = state(1, [*shared, gather(3, "layers.1.attn")], reason="error")
    assert diagnose({0: rank0, 1: without_experts}, {0: "died of SIGABRT"}).cause.key == "aborted"


def write_two_ranks(diagnostics, rank1_age_s: float) -> None:
    """Rank 0 dumped on a stall while waiting in collective #2; rank 1's last heartbeat (this process's pid, so
    alive) is `rank1_age_s` old."""
    import json
    import socket
    import time

    (diagnostics / "live").mkdir(parents=True)
    rank0 = state(0, [gather(1, "layers.0.attn"), gather(2, "layers.1.attn")], reason="stall", in_flight="#2")
    (diagnostics / "rank-0.json").write_text(json.dumps(rank0))
    beat = state(1, [gather(1, "layers.0.attn")], host=socket.gethostname(), pid=os.getpid())
    beat["updated"] = time.time() - rank1_age_s
    (diagnostics / "live" / "rank-1.json").write_text(json.dumps(beat))


def test_a_frozen_rank_is_named_as_the_cause_of_the_hang(tmp_path):
    """A rank whose process exists but whose heartbeat (written by its watchdog thread every second, even in a
    collective) stopped 30 s ago was frozen (SIGSTOP): the cause, not a stuck transport."""
    from tuneforge.diagnostics.report import build_report

    write_two_ranks(tmp_path, rank1_age_s=30)
    report = build_report(tmp_path, 2)
    lines = report.splitlines()
    assert lines[0] == "tuneforge diagnosis: HANG (frozen)", report
    assert "frozen: rank(s) 1" in lines and "likely cause: a rank that stopped running" in report


def test_a_killed_rank_is_a_failure_and_a_bus_error_names_the_mapped_file(tmp_path):
    from tuneforge.diagnostics.report import build_report

    write_two_ranks(tmp_path, rank1_age_s=2)
    killed = build_report(tmp_path, 2, {1: -9}).splitlines()
    assert killed[0] == "tuneforge diagnosis: FAILURE (killed)" and "died: rank(s) 1" in killed
    bus = build_report(tmp_path, 2, {1: -7})
    assert bus.splitlines()[0] == "tuneforge diagnosis: FAILURE (bus_error)", bus
    assert "rank 1 died of SIGBUS" in bus and "data.cache_dir" in bus
    alive = build_report(tmp_path, 2)  # a recent heartbeat: not frozen, the program's own reading stands
    assert "(frozen)" not in alive.splitlines()[0]
