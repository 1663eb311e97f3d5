"""The post-mortem's reading of per-rank collective records, on records written by hand."""

from __future__ import annotations

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
