"""Every file and path a config names, checked before anything is loaded: one message lists what is wrong.

A typo in `eval.exact_match.file` should not cost a whole training run, and a model id on a machine without
network should not cost five retries and a traceback. Everything here reads the file system (and, for a hub id
that is not cached, opens one connection to the hub with a short timeout); nothing is created or downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

from tuneforge.config.schema import Config, ModelConfig
from tuneforge.errors import UserError
from tuneforge.model.own_code import own_code_problem
from tuneforge.train.write_faults import nearest_existing

HUB_TIMEOUT_S = 3.0
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_inputs(cfg: Config, work_dir: Path) -> None:
    """Raise one UserError naming every missing or unusable input, each with its fix."""
    problems = [
        *_data_problems(cfg),
        *_model_problems(cfg.model),
        *_own_code_problems(cfg.model),
        *writable_problems("--work-dir", work_dir),
        *_cache_problems(cfg),
        *_engine_problems(cfg),
        *_context_problems(cfg),
    ]
    if problems:
        raise UserError("\n".join(problems))


def _engine_problems(cfg: Config) -> list[str]:
    if cfg.parallel.engine == "auto":
        return []  # `auto` picks an engine that reads no files; the launcher need not import the engines (2 s)
    from tuneforge.engines import input_problems

    return input_problems(cfg.parallel)


def check_data_inputs(cfg: Config) -> None:
    """What `tuneforge data check` and `data preview` need: the data files, the tokenizer (the model's when it
    has none of its own) and a `data.max_length` within the model's context, as `train` checks them."""
    model = cfg.model
    if model.tokenizer is not None:  # the weights are not read: only the tokenizer's files must be there
        model = model.model_copy(update={"path": None})
    problems = [*_data_problems(cfg), *_model_problems(model), *_cache_problems(cfg), *_context_problems(cfg)]
    if problems:
        raise UserError("\n".join(problems))


def _data_problems(cfg: Config) -> list[str]:
    named = [("data.train_files", f) for f in cfg.data.train_files]
    named += [("data.validation_files", f) for f in cfg.data.validation_files]
    if cfg.eval.exact_match is not None:
        named.append(("eval.exact_match.file", cfg.eval.exact_match.file))
    problems = []
    for key, path in named:
        if not Path(path).exists():
            problems.append(f"{key}: {path} not found (relative paths are read from the config file's directory)")
        elif not (Path(path).is_file() or Path(path).is_dir()):
            # A pipe would block the read with nothing said, a device would be read without end.
            problems.append(
                f"{key}: {path} is not a regular file (a pipe such as `<(...)`, or a device): the data is read more "
                "than once; write it to a file"
            )
        elif unreadable := _unreadable(Path(path)):
            problems.append(f"{key}: {unreadable} cannot be read by this user; fix its permissions (chmod a+r)")
    return problems


def _unreadable(path: Path) -> Path | None:
    """The first file (of a file, or of a directory's tree) this process may not read."""
    files = [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file()]
    return next((file for file in files if not os.access(file, os.R_OK)), None)


def _model_problems(model: ModelConfig) -> list[str]:
    problems = []
    if model.path is not None:
        problems += _source_problems("model.path", model.path, MODEL_FILES)
    tokenizer = model.tokenizer or model.path
    if tokenizer not in (None, "bytes") and not (model.tokenizer is None and problems):
        problems += _source_problems("model.tokenizer" if model.tokenizer else "model.path", tokenizer, TOKENIZER_FILES)
    return problems


def _own_code_problems(model: ModelConfig) -> list[str]:
    """A model folder that would need its own Python code to load (see `tuneforge.model.own_code`)."""
    problem = own_code_problem(model.path, model.trust_remote_code) if model.path is not None else None
    return [problem] if problem else []


def _looks_like_hub_id(value: str) -> bool:
    return not value.startswith(("/", ".", "~")) and value.count("/") == 1 and "\\" not in value


def _source_problems(key: str, value: str, needed: tuple[str, ...]) -> list[str]:
    path = Path(value).expanduser()
    if path.is_dir():
        if any((path / name).exists() for name in needed):
            return []
        inside = sorted(p.parent.name for p in path.glob(f"*/{needed[0]}"))
        hint = f"; its subdirectories {', '.join(inside)} have one" if inside else ""
        return [f"{key}: {value} has no {' or '.join(needed)}: not a Hugging Face directory{hint}"]
    if path.exists():
        return [f"{key}: {value} is a file; give the directory that holds {needed[0]}"]
    if not _looks_like_hub_id(value):
        return [f"{key}: {value} does not exist"]
    if _cached(value, needed):
        return []
    fetch = f"download it where there is network (`hf download {value} --local-dir DIR`) and set {key}: DIR"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return [f"{key}: {value} is not found locally and HF_HUB_OFFLINE is set; {fetch}"]
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not _reachable(endpoint):
        return [f"{key}: {value} is not found locally; the hub ({endpoint}) is unreachable from here; {fetch}"]
    return []


def _cached(repo_id: str, needed: tuple[str, ...]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in needed)


def _reachable(endpoint: str) -> bool:
    """One TCP connection to the hub with a short timeout: no retries, no download."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=HUB_TIMEOUT_S):
            return True
    except OSError:
        return False


def writable_problems(what: str, directory: Path) -> list[str]:
    """The directory, or the nearest ancestor that exists, must be a writable directory."""
    existing = nearest_existing(directory.resolve())
    if not existing.is_dir():
        return [f"{what} {directory}: {existing} is a file, not a directory; choose another path"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"{what} {directory}: {existing} is not writable by this user; choose a directory you can write"]
    return []


def _cache_problems(cfg: Config) -> list[str]:
    if cfg.data.cache_dir is None:
        return []
    return writable_problems("data.cache_dir", Path(cfg.data.cache_dir).expanduser())


def _context_problems(cfg: Config) -> list[str]:
    """`data.max_length` beyond the positions the model was trained for: positions past its context are
    untrained, so long samples would teach garbage unless the user extends the context on purpose."""
    if cfg.data.allow_beyond_context:
        return []
    context = model_context(cfg.model)
    if context is None or cfg.data.max_length <= context:
        return []
    return [
        f"data.max_length: {cfg.data.max_length} is beyond the model's context ({context} positions, "
        "max_position_embeddings); lower it, or set data.allow_beyond_context: true when you extend the context "
        "on purpose (with RoPE scaling)"
    ]


def model_context(model: ModelConfig) -> int | None:
    """The model's `max_position_embeddings` from its `config.json` or the size given for a fresh model; None
    when neither says (a fresh model then has its architecture's default). Read as plain JSON: the launcher
    checks inputs before it starts the workers, and importing `transformers` for this would delay them."""
    if model.architecture is not None:
        value = model.size.get("max_position_embeddings")
    elif model.path is not None and (Path(model.path) / "config.json").is_file():
        try:
            config = json.loads((Path(model.path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    else:
        return None
    return value if isinstance(value, int) else None


def checkpoint_bytes(total: int, trainable: int, weight_bytes: int, adapter: bool) -> int:
    """About what one step checkpoint takes: the saved weights (the adapters alone, in fp32, or the whole model
    in its weight dtype) and the training state (fp32 trainable weights and AdamW's two moments)."""
    weights = 4 * trainable if adapter else weight_bytes * total
    return weights + 12 * trainable


def disk_room_problems(directory: Path, needed: int, keep: int | None) -> tuple[list[str], list[str]]:
    """(errors, warnings) for `needed` bytes per checkpoint in `directory` (or its nearest existing parent)."""
    existing = nearest_existing(directory.resolve())
    free = shutil.disk_usage(existing).free
    gib = f"{needed / 2**30:.2f} GiB"
    if free < needed:
        return [
            f"--work-dir {directory}: {free / 2**30:.2f} GiB free, and one checkpoint of this run takes about {gib}; "
            "free space, choose another --work-dir, or save nothing (checkpoint.every_steps: 0, "
            "checkpoint.save_final: false)"
        ], []
    if free < needed * ((keep or 1) + 1):
        return [], [
            f"warning: --work-dir {directory}: {free / 2**30:.2f} GiB free holds {free // needed} checkpoint(s) of "
            f"about {gib}; checkpoint.keep_last is {keep}, and one more is written before the oldest goes"
        ]
    return [], []
