"""Checkpoints in Hugging Face format, written atomically, with the newest K kept."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tuneforge.checkpoint_records import CHAT_META, MANIFEST
from tuneforge.errors import UserError
from tuneforge.model.portable_adapter import make_portable, plain_skeleton
from tuneforge.model.unloaded_weights import copy_unloaded, recall

_STEP_DIR = re.compile(r"^step-(\d+)$")


def write_model_files(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    meta: dict[str, Any],
    config_file: Path | None = None,
    state_dict: dict | None = None,
    processor: Any = None,
) -> str:
    """The Hugging Face part of a checkpoint (weights or adapter, tokenizer, chat meta) into `directory`.
    `state_dict` holds the whole model's weights when the model itself is sharded. Returns a line saying how an
    adapter's config was written for PEFT's loader, if it had to be."""
    generation = getattr(model, "generation_config", None)  # a reward model has none: it does not generate
    if generation is not None:
        generation.eos_token_id = tokenizer.eos_token_id
        generation.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory, safe_serialization=True, state_dict=state_dict)
    adapter = hasattr(model, "peft_config")
    note = ""
    if adapter:
        base = model.get_base_model()
        note = make_portable(directory, base.config.model_type, plain_skeleton(type(base), base.config))
    if not adapter:  # an adapter's base keeps its own; a full model carries what transformers did not load
        copy_unloaded(recall(model), directory)
    # A vision-language model's processor: its tokenizer, image processor and chat template, for
    # `AutoProcessor.from_pretrained`.
    (processor if processor is not None else tokenizer).save_pretrained(directory)
    (directory / CHAT_META).write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")
    if config_file is not None:
        shutil.copy2(config_file, directory / "config.tuneforge.yaml")
    return note


def temporary_dir(directory: Path) -> Path:
    """Where a checkpoint is written before it is committed; never picked up by resume or pruning."""
    return directory.parent / f".tmp-{directory.name}"


def remove_entry(path: Path, ignore_errors: bool = False) -> bool:
    """Remove `path` from its directory without ever following it: a symbolic link (to a directory outside the
    work dir, in a work dir someone handed over) is unlinked, and what it points to is left alone; a directory is
    removed with all it holds. Returns whether `path` is gone (with `ignore_errors`, a failure is not raised but
    said in the result)."""
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
    except OSError:
        if not ignore_errors:
            raise
    return not os.path.lexists(path)


def fresh_dir(path: Path) -> None:
    """An empty directory at `path` created by this process: whatever stood there (a half-written copy, or a link
    someone planted) removed without being followed, and the directory made with `exist_ok=False`, so that what
    is written into it never lands elsewhere."""
    remove_entry(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()


def current_umask() -> int:
    """The process's umask, read without changing it (Linux names it in /proc; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_as_umask_allows(directory: Path) -> None:
    """Give every file and directory under `directory` the modes the umask allows: some writers (safetensors)
    create files readable by their owner only, which hides a group-shared run's weights from the group. Special
    bits (a shared directory's setgid) stay; a file system that refuses modes (some network mounts) is left as
    it is."""
    mask = current_umask()
    for path in [directory, *directory.rglob("*")]:
        with contextlib.suppress(OSError):
            mode = path.stat().st_mode
            wanted = 0o777 if path.is_dir() or mode & 0o100 else 0o666
            path.chmod((mode & 0o7000) | (wanted & ~mask))


def commit_checkpoint(tmp: Path, directory: Path) -> Path:
    """Flush every file, list it in the manifest, give it the umask's modes, then rename: a crash at any point
    leaves either the old checkpoint or the new one."""
    sizes = {}
    for file in sorted(tmp.rglob("*")):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
            sizes[file.relative_to(tmp).as_posix()] = file.stat().st_size
    (tmp / MANIFEST).write_text(json.dumps({"files": sizes}, indent=1))
    share_as_umask_allows(tmp)
    if os.path.lexists(directory):  # a link in its place is renamed away as a link, never followed
        old = directory.parent / f".old-{directory.name}"
        remove_entry(old)
        directory.rename(old)
        tmp.rename(directory)
        # The new copy is in place: an old one that cannot be removed now (a file held open on NFS) is left for
        # the next run's start (`tidy_checkpoints`), not reported as a failed save.
        remove_entry(old, ignore_errors=True)
    else:
        tmp.rename(directory)
    return directory


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    meta: dict[str, Any],
    config_file: Path | None = None,
    state_dict: dict | None = None,
) -> Path:
    """A model-only checkpoint from one process, written atomically."""
    tmp = temporary_dir(directory)
    fresh_dir(tmp)
    write_model_files(model, tokenizer, tmp, meta, config_file, state_dict)
    return commit_checkpoint(tmp, directory)


def directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def step_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """`step-N` checkpoints, oldest first."""
    if not checkpoints_dir.exists():
        return []
    found = [(int(m.group(1)), p) for p in checkpoints_dir.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found)


ABANDONED = "abandoned"
"""Under `checkpoints/`: step checkpoints newer than the one a run resumed from (see `set_aside_newer`)."""


def set_aside_newer(checkpoints_dir: Path, step: int) -> list[str]:
    """Step checkpoints newer than `step`, the one this run resumes from, belong to the continuation the resumed
    run replaces (its logs are cut back to `step` too). Left in place, keep-last pruning, which keeps the highest
    steps, would delete the resumed run's new checkpoints before them, and `--resume auto` would go back to them.
    Moved to `checkpoints/abandoned/`, never deleted; a line for each."""
    lines = []
    for _, path in step_checkpoints(checkpoints_dir):
        if int(path.name.removeprefix("step-")) <= step:
            continue
        abandoned = checkpoints_dir / ABANDONED
        if abandoned.is_symlink():
            raise UserError(
                f"{abandoned} is a symbolic link (to {os.readlink(abandoned)}): tuneforge moves set-aside checkpoints "
                "only within the work dir and never through a link; remove the link (or replace it with a copy of "
                "what it points to), then start again"
            )
        target, copies = abandoned / path.name, 0
        while os.path.lexists(target):
            copies += 1
            target = abandoned / f"{path.name}.{copies}"
        abandoned.mkdir(exist_ok=True)
        path.rename(target)  # a link is moved as a link
        lines.append(
            f"resume: {path} is newer than step {step}, which this run goes on from: moved to {target} (delete it "
            "when it is no longer needed)"
        )
    return lines


def tidy_checkpoints(checkpoints_dir: Path) -> list[str]:
    """What a run killed while saving left behind, cleared before this run resolves its resume point: a
    half-written `.tmp-NAME` is removed (a resumed run may never save NAME again), and a `.old-NAME`, the copy a
    replacement was about to remove, is put back where the kill came between its two renames, else removed.
    Returns a line for each.

    Symbolic links are never followed: a `.tmp-`/`.old-` link (left in a work dir someone handed over) is
    unlinked, what it points to left alone; a link in the place of a checkpoint tuneforge writes (`step-N`,
    `final`, `best`, `abandoned`) is refused, since saving or resuming through it would read or write outside
    the work dir."""
    lines: list[str] = []
    if not checkpoints_dir.is_dir():
        return lines
    entries = sorted(checkpoints_dir.iterdir())
    for path in entries:
        if path.is_symlink() and (_STEP_DIR.match(path.name) or path.name in OWN_NAMES):
            raise UserError(
                f"{path} is a symbolic link (to {os.readlink(path)}), not a checkpoint this run wrote: tuneforge "
                "neither resumes from nor writes through links in its checkpoints dir. Replace it with a copy of "
                f"the checkpoint (`cp -rL`), or remove it, then start again (a checkpoint elsewhere: --resume PATH)"
            )
    for path in entries:
        if not path.name.startswith((".tmp-", ".old-")):
            continue
        if path.is_symlink():
            target = os.readlink(path)
            if remove_entry(path, ignore_errors=True):
                lines.append(f"checkpoints: removed the link {path} (not followed: {target} is left as it was)")
            else:
                lines.append(f"checkpoints: warning: could not remove the link {path}; remove it by hand")
            continue
        if not path.is_dir():
            continue
        if path.name.startswith(".tmp-"):
            lines.append(_removed(path, "half-written when an earlier run stopped"))
        else:
            kept = path.with_name(path.name.removeprefix(".old-"))
            if os.path.lexists(kept):
                lines.append(_removed(path, f"the copy {kept} replaced"))
            else:
                path.rename(kept)
                lines.append(f"checkpoints: {kept} put back from {path}: a run stopped while replacing it")
    return lines


OWN_NAMES = ("final", "best", ABANDONED)
"""Entries of `checkpoints/` besides `step-N` that tuneforge writes into or moves things into."""


def _removed(path: Path, why: str) -> str:
    if remove_entry(path, ignore_errors=True):
        return f"checkpoints: removed {path}, {why}"
    return f"checkpoints: warning: could not remove {path} ({why}); remove it by hand"


def prune_checkpoints(checkpoints_dir: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest `keep_last` step checkpoints; returns what was removed."""
    if keep_last is None:
        return []
    removed = [path for _, path in step_checkpoints(checkpoints_dir)[:-keep_last]]
    for path in removed:
        remove_entry(path)  # a link is unlinked: what it points to, outside the work dir, is never deleted
    return removed
