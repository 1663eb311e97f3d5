"""One report from every rank's dump: where each rank is, where their collectives part, who diverged or died,
and the likely cause with its fix.

Inputs are the per-rank dumps written at a stall or error (`diagnostics/rank-R.json`) and, for ranks that
could not dump (killed, crashed), their last heartbeat (`diagnostics/live/rank-R.json`), exit status, the
stacks faulthandler wrote if a fatal signal ended them (`diagnostics/fatal-rank-R.txt`) and the collective
they had in flight (the recorder's black box).
Everything here is a pure function of those files, so `tuneforge diagnose` can rebuild a report later.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from tuneforge.diagnostics.causes import CAUSES, Cause
from tuneforge.diagnostics.files import (
    HEARTBEAT_EVERY_S,
    REPORT,
    TRAINING_PHASES,
    black_box_file,
    fatal_stacks_file,
    process_start_ticks,
    read_json,
    same_process_alive,
)
from tuneforge.diagnostics.recorder import _is_library, read_black_box
from tuneforge.terminal import safe_text

EXPERT_MODULE = re.compile(r"(^|\.)experts(\.|$)")
RANK_ONLY_PHASES = ("save", "eval", "generation")


@dataclass
class Diagnosis:
    cause: Cause
    diverged: list[int]
    detail: list[str] = field(default_factory=list)


def _alive(heartbeat: dict | None) -> bool | None:
    """Whether a rank's process still exists (None when it ran on another host, or left no heartbeat)."""
    return same_process_alive(heartbeat) if heartbeat is not None else None


FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')
COLLECTIVE_FILES = ("distributed_c10d.py", "tuneforge/diagnostics/recorder.py")
SENT_FROM_OUTSIDE = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class FatalSignal:
    """What faulthandler wrote when a rank died of a fatal signal."""

    error: str
    """Its first line, such as `Fatal Python error: Aborted`."""
    site: str
    """The innermost frame outside torch and DeepSpeed of the thread that was in a collective (or of the
    deepest stack): the code that issued the call the rank died in."""


def read_fatal_signal(path: Path) -> FatalSignal | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    if not text.strip():
        return None
    stacks = []
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text):
        frames = [m for line in block.splitlines() if (m := FRAME.match(line))]  # innermost first
        if frames:
            stacks.append(frames)
    in_collective = [f for f in stacks if any(m["file"].endswith(COLLECTIVE_FILES) for m in f)]
    chosen = (in_collective or sorted(stacks, key=len, reverse=True) or [[]])[0]
    site = next((f"{m['file']}:{m['line']} in {m['name']}" for m in chosen if not _is_library(m["file"])), "")
    return FatalSignal(text.strip().splitlines()[0].strip(), site)


def _exit_description(code: int) -> str:
    if code > 128 and code - 128 in (signal.SIGTERM, signal.SIGKILL):
        code = 128 - code  # 143: a shell-style exit after SIGTERM
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        # SIGABRT, SIGSEGV and the like come from the process itself (gloo and NCCL abort on a mismatch).
        return f"killed by {name}" if -code in SENT_FROM_OUTSIDE else f"died of {name}"
    return f"exited with status {code}"


def _first_divergence(sequences: dict[int, dict[int, dict]]) -> tuple[int, dict[int, dict | None]] | None:
    """The first sequence number at which the ranks' records differ (or some rank has none), with each rank's
    record there. Only the range every ring buffer still holds is compared."""
    start = max(min(seq) if seq else 1 for seq in sequences.values())
    end = max(max(seq) if seq else 0 for seq in sequences.values())
    for number in range(start, end + 1):
        # A rank that holds later records but not this one issued it unseen (a dead rank's heartbeat lags
        # behind its black box): unknown, not absent.
        at = {rank: seq.get(number) for rank, seq in sequences.items() if number in seq or max(seq, default=0) < number}
        if len(at) < 2:
            continue
        signatures = {
            (r["op"], tuple(map(tuple, r["shapes"])), tuple(r["dtypes"])) if r is not None else None
            for r in at.values()
        }
        if len(signatures) > 1:
            return number, at
    return None


def _first_expert_split(sequences: dict[int, dict[int, dict]]) -> tuple[int, dict[int, dict]] | None:
    """The first sequence number every rank holds at which their records name different modules, one of them
    an MoE block's experts, with each rank's record there."""
    common = set.intersection(*(set(seq) for seq in sequences.values())) if sequences else set()
    for number in sorted(common):
        at = {rank: seq[number] for rank, seq in sequences.items()}
        modules = {record["module"] or "" for record in at.values()}
        if len(modules) > 1 and any(EXPERT_MODULE.search(module) for module in modules):
            return number, at
    return None


def _first_expert_collective(sequences: dict[int, dict[int, dict]]) -> tuple[int, dict] | None:
    """The earliest recorded collective issued inside an MoE block's experts, with its rank."""
    found = [
        (number, rank, record)
        for rank, seq in sequences.items()
        for number, record in seq.items()
        if EXPERT_MODULE.search(record["module"] or "")
    ]
    if not found:
        return None
    _, rank, record = min(found, key=lambda item: (item[0], item[1]))
    return rank, record


def _describe_record(record: dict | None) -> str:
    if record is None:
        return "nothing (never issued it)"
    tensors = (
        ", ".join(f"{tuple(s)} {d}" for s, d in zip(record["shapes"], record["dtypes"], strict=False)) or "no tensors"
    )
    site = f" from {_short(record['site'])}" if record.get("site") else ""
    return f"{record['op']}({tensors}) in {record['module'] or '-'} [{record['phase']}]{site}"


def _short(site: str) -> str:
    """A call site with an installed package's path cut to the package."""
    return site.split("site-packages/", 1)[-1]


def _sites_only_on(sequences: dict[int, dict[int, dict]], at: dict[int, dict | None]) -> dict[int, dict]:
    """The ranks whose collective at the divergence came from a line that no other rank issued any recorded
    collective from: an extra collective on that rank (or one the others skip)."""
    sites = {rank: {record.get("site") for record in seq.values()} for rank, seq in sequences.items()}
    lonely = {}
    for rank, record in at.items():
        if record is None or not record.get("site"):
            continue
        if not any(record["site"] in found for other, found in sites.items() if other != rank):
            lonely[rank] = record
    return lonely if len(lonely) < len(at) else {}


def _signature(record: dict) -> tuple:
    return record["op"], tuple(map(tuple, record["shapes"])), tuple(record["dtypes"])


def _extra_on(sequences: dict[int, dict[int, dict]], number: int) -> list[int]:
    """Ranks that issued one collective more at `number`: the rest of their sequence equals the others' shifted
    by one. Empty when it cannot be told (for example when every rank stopped at `number`)."""
    extra = []
    for rank, seq in sequences.items():
        others = [s for r, s in sequences.items() if r != rank]
        pairs = [(seq[n + 1], other[n]) for other in others for n in other if n >= number and n + 1 in seq]
        if pairs and all(_signature(mine) == _signature(theirs) for mine, theirs in pairs):
            extra.append(rank)
    return extra if len(extra) < len(sequences) else []


def _minority(at: dict[int, dict | None]) -> list[int]:
    groups: dict[tuple | None, list[int]] = {}
    for rank, record in at.items():
        groups.setdefault(_signature(record) if record is not None else None, []).append(rank)
    sizes = sorted(len(g) for g in groups.values())
    if len(groups) < 2 or sizes[0] == sizes[-1]:
        return []
    return sorted(min(groups.values(), key=len))


FROZEN = "stopped reporting"
"""How a rank whose process exists but whose heartbeat went stale is described."""
STALE_HEARTBEAT_S = 5 * HEARTBEAT_EVERY_S
"""A live rank's watchdog thread writes its heartbeat every second, even while its main thread waits in a
collective: a heartbeat older than this belongs to a process that is not running."""

EXTERNAL_KILLS = ("SIGKILL", "never reported", "is gone", "stopped reporting")
"""Deaths that come from outside the program (OOM killer, scheduler, operator) rather than from a mismatch."""


def diagnose(states: dict[int, dict], missing: dict[int, str]) -> Diagnosis:
    """`states`: the dumps (or last heartbeats) of ranks; `missing`: ranks that died, with how. A rank killed
    from outside is the cause; a rank that aborted (gloo aborts on a mismatched collective) is usually the
    consequence of a divergence, which is then named, with the death in the details."""
    died = [f"rank {r} {how}" for r, how in sorted(missing.items())]
    bus_errors = sorted(r for r, how in missing.items() if "Bus error" in how or "SIGBUS" in how)
    if bus_errors:
        return Diagnosis(CAUSES["bus_error"], bus_errors, died)
    if missing and all(how.startswith(FROZEN) for how in missing.values()):
        return Diagnosis(CAUSES["frozen"], sorted(missing), died)
    if any(any(k in how for k in EXTERNAL_KILLS) for how in missing.values()):
        return Diagnosis(CAUSES["killed"], sorted(missing), died)
    found = _diagnose_program(states)
    if missing and found.cause.key in ("same_collective", "stuck"):
        fatal = sorted(r for r, how in missing.items() if how.startswith("died of"))
        # A rank that aborted published its collectives up to its last heartbeat only, which can end before
        # the ranks parted; experts that issued collectives of their own anywhere still name the MoE cause.
        everything = {r: {c["seq"]: c for c in st.get("collectives", [])} for r, st in states.items()}
        expert_collective = _first_expert_collective(everything)
        if fatal and expert_collective is not None:
            rank, record = expert_collective
            detail = [
                f"the experts issue collectives of their own (rank {rank}: {_describe_record(record)}, "
                f"#{record['seq']}), so each rank's sequence follows its own tokens' choice of experts",
                *(
                    f"{line} (a consequence: gloo and NCCL abort a rank whose collectives do not pair up)"
                    for line in died
                ),
            ]
            return Diagnosis(CAUSES["moe"], [], detail)
        return Diagnosis(CAUSES["aborted" if fatal else "killed"], fatal or sorted(missing), died)
    found.detail.extend(f"{line} (a consequence)" for line in died)
    return found


def _diagnose_program(states: dict[int, dict]) -> Diagnosis:
    if len(states) == 1:
        return Diagnosis(CAUSES["stuck"], [], [])
    sequences = {r: {c["seq"]: c for c in s.get("collectives", [])} for r, s in states.items()}
    # A rank known only from its last heartbeat may have issued more than it published: compare up to there.
    published = [max(seq, default=0) for r, seq in sequences.items() if "reason" not in states[r]]
    if published:
        horizon = min(published)
        sequences = {r: {n: c for n, c in seq.items() if n <= horizon} for r, seq in sequences.items()}
    divergence = _first_divergence(sequences) if len(sequences) > 1 else None
    detail: list[str] = []
    diverged: list[int] = []
    extra: list[int] = []
    absent: list[int] = []
    if divergence is not None:
        number, at = divergence
        detail.append(f"first disagreement at collective #{number}:")
        detail.extend(f"  rank {rank}: {_describe_record(record)}" for rank, record in sorted(at.items()))
        extra = _extra_on(sequences, number)
        absent = [r for r, rec in at.items() if rec is None]
        diverged = extra or (absent if 0 < len(absent) < len(at) else []) or _minority(at)
        if any(EXPERT_MODULE.search(rec["module"] or "") for rec in at.values() if rec is not None):
            return Diagnosis(CAUSES["moe"], diverged or sorted(at), detail)
    split = _first_expert_split(sequences)
    if split is not None:
        # Same op and shapes on every rank, different experts: the collectives still pair up (each expert's
        # parameters are the same size), so the ranks run on until a count differs (a hang) or a check such
        # as DeepSpeed's trace comparison notices.
        number, at = split
        detail.append(f"first collective the ranks issued for different experts (#{number}):")
        detail.extend(f"  rank {rank}: {_describe_record(record)}" for rank, record in sorted(at.items()))
        return Diagnosis(CAUSES["moe"], [], detail)  # no rank is at fault: each follows its own tokens
    in_experts = {
        r: last
        for r, s in states.items()
        if "reason" in s and (last := (s.get("collectives") or [None])[-1]) and EXPERT_MODULE.search(last["module"])
    }
    if in_experts:
        detail.append("last collective of the rank(s) that stopped inside an MoE block's experts:")
        detail.extend(f"  rank {r}: {_describe_record(rec)} (#{rec['seq']})" for r, rec in sorted(in_experts.items()))
        return Diagnosis(CAUSES["moe"], diverged, detail)
    over_plan = [
        r
        for r, s in states.items()
        if (s.get("micro_steps") and s.get("micro_step", 0) > s["micro_steps"])
        or (s.get("total_steps") and s.get("step", 0) > s["total_steps"])
    ]
    if over_plan:
        return Diagnosis(CAUSES["uneven_data"], over_plan, detail)
    phases = {r: s.get("phase") for r, s in states.items()}
    if divergence is not None and all(p == "generation" for p in phases.values()):
        return Diagnosis(CAUSES["generation"], diverged, detail)
    in_rank_only = [r for r, p in phases.items() if p in RANK_ONLY_PHASES]
    if in_rank_only and any(p in TRAINING_PHASES for p in phases.values()):
        return Diagnosis(CAUSES["rank_only_path"], sorted(in_rank_only), detail)
    if divergence is None:
        return Diagnosis(CAUSES["same_collective"], [], detail)
    expert_collective = _first_expert_collective(sequences)
    if expert_collective is not None:
        # Experts that gather or reduce their own parameters make each rank's collectives depend on its own
        # tokens' routing; where the sequences then part can be far from the experts (under DeepSpeed its
        # prefetching follows a trace recorded from one step's routing).
        rank, record = expert_collective
        detail.append(
            f"the experts issue collectives of their own (rank {rank}: {_describe_record(record)}, "
            f"#{record['seq']}), so each rank's sequence follows its own tokens' choice of experts"
        )
        return Diagnosis(CAUSES["moe"], [], detail)
    if extra or absent:
        number, at = divergence
        issuers = extra or sorted(set(at) - set(absent))
        op = next((at[r]["op"] for r in issuers if at[r] is not None), "a collective")
        others = sorted(set(at) - set(issuers))
        detail.append(
            f"rank(s) {', '.join(map(str, issuers))} issued {op} #{number}, which rank(s) "
            f"{', '.join(map(str, others))} did not (skipped it, or the former took a path the others did not)"
        )
        return Diagnosis(CAUSES["skipped_collective"], diverged, detail)
    lonely = _sites_only_on(sequences, divergence[1])
    for rank, record in sorted(lonely.items()):
        detail.append(
            f"rank {rank} issued {record['op']} #{record['seq']} from {_short(record['site'])}, a line no other "
            "rank issued a collective from: an extra collective on that rank, or one the others skip"
        )
    return Diagnosis(CAUSES["mismatch"], sorted(lonely) or diverged, detail)


def _with_black_box(heartbeat: dict, in_flight: dict | None) -> dict:
    """A dead rank's last heartbeat, completed with the collective it had in flight when it died (which it
    issued after its last heartbeat, or while blocked in it)."""
    known = heartbeat.get("collectives") or []
    if in_flight is None or (known and in_flight["seq"] <= known[-1]["seq"]):
        return heartbeat
    return {**heartbeat, "collectives": [*known, in_flight], "in_flight": _describe_record(in_flight)}


def _where(rank: int, state: dict, source: str) -> str:
    micro = f" micro-step {state.get('micro_step')}/{state.get('micro_steps')}" if state.get("micro_steps") else ""
    parts = [f"rank {rank} ({source}): phase {state.get('phase')}, step {state.get('step')}{micro}"]
    if state.get("module"):
        parts.append(f"module {state['module']}")
    if state.get("where"):
        parts.append(f"at {state['where']}")
    if state.get("in_flight"):
        parts.append(f"waiting in {state['in_flight']}")
    if state.get("detail"):
        parts.append(state["detail"])
    return "; ".join(parts)


def build_report(diagnostics_dir: Path, world_size: int, exit_codes: dict[int, int] | None = None) -> str:
    """The report text from the files under `diagnostics_dir` (and the launcher's exit codes, if known), safe
    to print: what the ranks' files say is shown, never acted on by the terminal."""
    return safe_text(_report_text(diagnostics_dir, world_size, exit_codes))


def _report_text(diagnostics_dir: Path, world_size: int, exit_codes: dict[int, int] | None) -> str:
    exit_codes = exit_codes or {}
    states: dict[int, dict] = {}
    lines = []
    missing: dict[int, str] = {}
    for rank in range(world_size):
        dump = read_json(diagnostics_dir / f"rank-{rank}.json")
        heartbeat = read_json(diagnostics_dir / "live" / f"rank-{rank}.json")
        if dump is not None:
            states[rank] = dump
            lines.append(_where(rank, dump, dump.get("reason", "dump")))
            continue
        code = exit_codes.get(rank)
        alive = _alive(heartbeat)
        fatal = read_fatal_signal(fatal_stacks_file(diagnostics_dir, rank))
        if heartbeat is not None:
            heartbeat = _with_black_box(heartbeat, read_black_box(black_box_file(diagnostics_dir, rank)))
            states[rank] = heartbeat
            age = time.time() - heartbeat["updated"]
            if fatal is not None:
                how = f"died of a fatal signal ({fatal.error})" + (f" at {fatal.site}" if fatal.site else "")
            elif code is not None:
                how = _exit_description(code)
            else:
                how = "is gone (its process no longer exists)" if alive is False else f"{FROZEN} {age:.0f}s ago"
            lines.append(_where(rank, heartbeat, f"last heartbeat {age:.0f}s ago") + f"; {how}")
            frozen = code is None and alive is not False and age > STALE_HEARTBEAT_S and fatal is None
            if (
                (code is not None and code != 0 and code != -signal.SIGTERM)
                or alive is False
                or fatal is not None
                or (frozen and not heartbeat.get("finished"))
            ):
                missing[rank] = how
        else:
            how = _exit_description(code) if code is not None else "never reported"
            lines.append(f"rank {rank}: no heartbeat; {how}")
            if code is None or code not in (0, -signal.SIGTERM):
                missing[rank] = how
    diagnosis = diagnose(states, missing)
    stalled = any(s.get("reason") == "stall" for s in states.values())
    # A rank that died is a failure the others would hang on; a frozen rank or a stuck transport is a hang.
    dead = diagnosis.cause.key in ("killed", "aborted", "bus_error")
    kind = "HANG" if not dead and (stalled or diagnosis.cause.key in ("frozen", "same_collective")) else "FAILURE"
    who = f"rank(s) {', '.join(map(str, diagnosis.diverged))}" if diagnosis.diverged else "no single rank"
    if not diagnosis.diverged and diagnosis.cause.key == "moe":
        who = "every rank, each after its own tokens' choice of experts"
    verdict = "died" if dead else "frozen" if diagnosis.cause.key == "frozen" else "diverged"
    text = [
        f"tuneforge diagnosis: {kind} ({diagnosis.cause.key})",
        "where each rank is:",
        *[f"  {line}" for line in lines],
        *diagnosis.detail,
        f"{verdict}: {who}",
        f"likely cause: {diagnosis.cause.title}",
        f"fix: {diagnosis.cause.fix}",
        f"stacks and collectives of every rank: {diagnostics_dir}/stacks-rank-*.txt, {diagnostics_dir}/rank-*.json",
    ]
    return "\n".join(text)


def _same_job(pid: int) -> bool:
    """Whether process `pid` is a worker of this torchrun job (its TORCHELASTIC_RUN_ID is ours): a heartbeat file
    names a pid, and a pid named by a file is never signalled on that word alone."""
    ours = os.environ.get("TORCHELASTIC_RUN_ID")
    if not ours:
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"TORCHELASTIC_RUN_ID={ours}".encode() in environ


def end_frozen_peers(diagnostics_dir: Path, world_size: int) -> list[str]:
    """SIGKILL the workers of this job on this host that stopped running (a heartbeat gone stale while the
    process exists): the job is ending, and the launcher would otherwise wait its shutdown timeout (30 s) on
    a process that cannot answer its SIGTERM. Returns a line for each."""
    lines = []
    for rank in range(world_size):
        if (diagnostics_dir / f"rank-{rank}.json").exists():
            continue  # it dumped: running
        beat = read_json(diagnostics_dir / "live" / f"rank-{rank}.json")
        if beat is None or _alive(beat) is not True or beat.get("finished"):
            continue
        if time.time() - beat["updated"] <= STALE_HEARTBEAT_S or not _same_job(int(beat["pid"])):
            continue
        started = beat.get("pid_started")
        if started is None or process_start_ticks(int(beat["pid"])) != started:
            continue  # the pid may name another process now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(beat["pid"]), signal.SIGKILL)
            lines.append(f"rank {rank} (process {beat['pid']}) was not running: killed, so the job ends now")
    return lines


def collect_and_report(diagnostics_dir: Path, rank: int, world_size: int, grace_s: float) -> str | None:
    """After this rank dumped: wait (bounded) for the other ranks' dumps; the lowest rank that dumped writes
    and returns the report, the others wait for it to exist and return None."""
    deadline = time.monotonic() + grace_s
    dumped: list[int] = []
    while time.monotonic() < deadline:
        dumped = [r for r in range(world_size) if (diagnostics_dir / f"rank-{r}.json").exists()]
        if len(dumped) == world_size:
            break
        time.sleep(0.2)
    if world_size == 1 or rank == min(dumped, default=rank):
        text = build_report(diagnostics_dir, world_size)
        ended = end_frozen_peers(diagnostics_dir, world_size)
        text = "\n".join([text, *ended])
        with contextlib.suppress(OSError):  # a full disk: the report is printed anyway
            (diagnostics_dir / REPORT).write_text(text + "\n")
        return text
    while time.monotonic() < deadline + grace_s and not (diagnostics_dir / REPORT).exists():
        time.sleep(0.2)
    return f"tuneforge watchdog: rank {rank} stopped; the report is in {diagnostics_dir / REPORT}"
