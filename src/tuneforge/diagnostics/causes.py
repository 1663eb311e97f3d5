"""The causes a diagnosis can name: for each, what happened in words a user can act on, and the fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    key: str
    title: str
    fix: str


CAUSES = {
    "killed": Cause(
        "killed",
        "a crashed or killed rank: the others wait forever in a collective it will never join",
        "read that rank's own error above or in its log; a rank killed by SIGKILL without a message is usually "
        "the kernel's OOM killer (check `dmesg`), so lower the memory per process (smaller micro-batch, "
        "parallel.cpu_offload, gradient checkpointing); then resume from the last checkpoint",
    ),
    "frozen": Cause(
        "frozen",
        "a rank that stopped running: its process exists but even its watchdog thread stopped writing its "
        "heartbeat (stopped by SIGSTOP or Ctrl-Z, a debugger, a machine swapping, a driver call that holds the "
        "interpreter), while the others wait for it in a collective",
        "find what froze that process (`ps -o stat,wchan PID` on its host: T is stopped, D waits on a device or "
        "disk) and end it; then resume from the last checkpoint with --resume auto",
    ),
    "bus_error": Cause(
        "bus_error",
        "a rank died of a bus error (SIGBUS): a file it had mapped into memory shrank or vanished under it (the "
        "data cache in data.cache_dir cut short, overwritten or deleted while the run read it; a network file "
        "system dropping it), or a memory fault",
        "leave data.cache_dir alone while a run reads it (the next run finds the damaged entry and rebuilds it), "
        "then resume from the last checkpoint with --resume auto",
    ),
    "moe": Cause(
        "moe",
        "an MoE block whose experts run only on some ranks: each rank gathers or reduces the parameters of the "
        "experts its own tokens picked, so the ranks issue different collectives (the original report's hang)",
        "keep parallel.moe_safety: true (MoE blocks become ZeRO-3 leaf modules; FSDP2 reduces zeros for idle "
        "experts), and prefer transformers' native implementation over trust_remote_code",
    ),
    "aborted": Cause(
        "aborted",
        "a rank died of a fatal signal of its own (SIGABRT, SIGSEGV); gloo and NCCL abort a rank whose collective "
        "does not pair up with its peers' (a different op or size), so the call it died in is the first suspect",
        "read that rank's stacks in diagnostics/fatal-rank-*.txt: the frame named above issued the call it died "
        "in; make every rank issue the same collectives in the same order, then resume from the last checkpoint",
    ),
    "uneven_data": Cause(
        "uneven_data",
        "uneven data: one rank runs a batch the others do not have, so it waits in that batch's collectives",
        "give every rank the same number of micro-batches per step (tuneforge's planner does; a custom sampler "
        "must pad or drop the remainder)",
    ),
    "generation": Cause(
        "generation",
        "generation of different lengths on sharded parameters: a rank that finished its replies stops calling "
        "forward, while the others still need it for every parameter gather",
        "generate with synced steps on every rank (tuneforge does for fsdp and ZeRO-3: synced_gpus=True)",
    ),
    "rank_only_path": Cause(
        "rank_only_path",
        "a code path taken by some ranks only (such as evaluation or saving on rank 0 alone) that issues a "
        "collective the other ranks never issue",
        "run evaluation, saving and any callback that touches the model on every rank, or keep collectives "
        "out of rank-0-only code",
    ),
    "skipped_collective": Cause(
        "skipped_collective",
        "the ranks' programs differ: one rank issued a collective the other skipped (a condition that differs "
        "between ranks, such as a data-dependent branch)",
        "make the branch the same on every rank (decide it from values all-reduced first), or issue the "
        "collective unconditionally",
    ),
    "mismatch": Cause(
        "mismatch",
        "the ranks issued different collectives at the same point (different ops or tensor shapes)",
        "compare the lines named above and the stacks in diagnostics/stacks-rank-*.txt (fatal-rank-*.txt for a "
        "rank that died): the code paths differ from there; make every rank issue the same collectives in order",
    ),
    "stuck": Cause(
        "stuck",
        "one process made no progress: its main thread is blocked at the line shown (a data source that never "
        "answers, a deadlocked worker, a kernel that never returns)",
        "read the main thread's stack in the stacks file; the innermost tuneforge or user frame is where it waits",
    ),
    "same_collective": Cause(
        "same_collective",
        "every rank waits in the same collective: no divergence in the program; the transport itself is stuck "
        "(network, NCCL/gloo configuration) or a rank outside this job holds it",
        "check the network between the nodes (NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME, NCCL_IB_* settings naming "
        "devices that exist) and rerun",
    ),
}
