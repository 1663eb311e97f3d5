"""Load a config: YAML file + dotted overrides -> validated ``Config``, or one line per mistake."""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tuneforge.config.schema import Config
from tuneforge.errors import UserError


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `train.lr=1e-4` into (["train", "lr"], 1e-4); the value is read as a YAML scalar."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"override {text!r}: expected KEY=VALUE with a dotted key, for example train.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise UserError(f"override {text!r}: value is not valid YAML ({exc.problem})") from None
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], keys: list[str], value: Any, origin: str) -> None:
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise UserError(f"override {origin!r}: `{'.'.join(keys[: i + 1])}` is a value, not a section")
        node = child
    node[keys[-1]] = value


def _line_of(root: yaml.Node | None, loc: tuple[str | int, ...], exact: bool = False) -> int | None:
    """1-based line of the YAML node at `loc`, or of its deepest existing parent (None then if `exact`)."""
    node, line = root, None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == part]
            if not match:
                return None if exact else line
            key_node, node = match[0]
            line = key_node.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return None if exact else line
    return line


EXPANDED_VALUES_LIMIT = 100_000
"""A config with aliases (`&a` ... `*a`) that stand for more values than this is refused unread: nested aliases
grow exponentially (a "billion laughs" file), and no config has this many settings."""


def _refuse_alias_bombs(root: yaml.Node | None, path: Path) -> None:
    """Count the values the document stands for, aliases expanded, stopping at the limit."""
    pending, count = [root], 0
    while pending:
        node = pending.pop()
        count += 1
        if count > EXPANDED_VALUES_LIMIT:
            raise UserError(
                f"{path}: its aliases (&name / *name) expand to more than {EXPANDED_VALUES_LIMIT:,} values; write "
                "the values out instead"
            )
        if isinstance(node, yaml.MappingNode):
            pending.extend(value for pair in node.value for value in pair)
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)


def _duplicate_keys(node: yaml.Node | None, prefix: str = "") -> list[tuple[str, int, int]]:
    """(dotted key, first line, repeated line) for every key given twice in one mapping: YAML keeps the last
    silently, so a value the user sees is not the one that trains."""
    found: list[tuple[str, int, int]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                found.append((prefix + key, seen[key], line))
            seen.setdefault(key, line)
            found.extend(_duplicate_keys(value_node, f"{prefix}{key}."))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found.extend(_duplicate_keys(item, f"{prefix}{index}."))
    return found


def _section_class(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The config class that owns the keys at `loc` (for did-you-mean suggestions)."""
    cls: type[BaseModel] = Config
    for part in loc:
        if not isinstance(part, str) or part not in cls.model_fields:
            return None
        annotation = cls.model_fields[part].annotation
        candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
        sections = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not sections:
            return None
        cls = sections[0]
    return cls


def _describe(error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        owner = _section_class(loc[:-1])
        known = list(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else f"; known keys: {', '.join(known)}"
        return f"unknown key{hint}"
    if error["type"] == "missing":
        return "required key is missing"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("value_error", "assertion_error"):
        given = repr(error["input"])
        message += f" (got {given if len(given) <= 200 else given[:200] + f'... ({len(given):,} characters)'})"
    return message


SCALAR_BRANCHES = ("str", "int", "float", "bool")
"""pydantic's names for the scalar branches of a union (`str | TemplateConfig`)."""


def _wrong_branch(error: dict, errors: list[dict]) -> bool:
    """A scalar branch's type error for a mapping given where the union also takes a section: the user meant
    the section, whose own errors say what is wrong with it."""
    loc = tuple(error["loc"])
    if not (loc and loc[-1] in SCALAR_BRANCHES and error["type"].endswith("_type")):
        return False
    if not isinstance(error.get("input"), dict):
        return False
    return any(tuple(other["loc"])[: len(loc) - 1] == loc[:-1] and other is not error for other in errors)


def _format_errors(exc: ValidationError, path: Path, root: yaml.Node | None, overridden: dict[str, str]) -> str:
    lines = []
    errors = exc.errors()
    for error in errors:
        if _wrong_branch(error, errors):
            continue
        # pydantic reports tuple items with int indices; union branches add class names.
        loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p[:1].isupper()))
        dotted = ".".join(str(p) for p in loc) or "<top level>"
        # An override names this key or a key inside it, or it created this section (`foo.bar=1` makes `foo`).
        origin = next((o for k, o in overridden.items() if dotted == k or dotted.startswith(k + ".")), None)
        if origin is None and _line_of(root, loc, exact=True) is None:
            origin = next((o for k, o in overridden.items() if k.startswith(dotted + ".")), None)
        if origin is not None:
            where = f"{path} (override {origin})"
        else:
            line = _line_of(root, loc)
            where = f"{path}:{line}" if line else str(path)
        lines.append(f"{where}: {dotted}: {_describe({**error, 'loc': loc})}")
    return "\n".join(lines)


def _resolved(key: str, path: Path) -> str:
    try:
        resolved = path.resolve()
        if path.exists() and not resolved.exists():  # `<(...)`'s /dev/fd/N: its link names a pipe, not a path
            return str(path.absolute())
        return str(resolved)
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13), or unreadable
        raise UserError(f"{key}: {path} cannot be resolved ({exc}); point it at the file itself") from None


def _resolve_paths(config: Config, base: Path) -> Config:
    """Data paths are relative to the config file; model paths only when such a directory exists."""
    config.data.train_files = [_resolved("data.train_files", base / f) for f in config.data.train_files]
    config.data.validation_files = [_resolved("data.validation_files", base / f) for f in config.data.validation_files]
    if config.eval.exact_match is not None:
        config.eval.exact_match.file = _resolved("eval.exact_match.file", base / config.eval.exact_match.file)
    if config.data.image_root is not None:
        config.data.image_root = _resolved("data.image_root", base / config.data.image_root)
    vision = config.model.vision
    if vision is not None and vision.projector_weights is not None:
        vision.projector_weights = _resolved("model.vision.projector_weights", base / vision.projector_weights)
    if vision is not None and vision.tower_path is not None and _exists(base / vision.tower_path):
        vision.tower_path = _resolved("model.vision.tower_path", base / vision.tower_path)
    for field in ("path", "tokenizer"):
        value = getattr(config.model, field)
        if value and value != "bytes" and _exists(base / value):
            setattr(config.model, field, _resolved(f"model.{field}", base / value))
    for index, reward in enumerate(config.rl.rewards):  # a reward model beside the config, like its data
        if reward.path is not None:
            reward.path = _resolved(f"rl.rewards[{index}].path", base / reward.path)
    if config.eval.lm_eval is not None:  # local task files beside the config, like its data; harness names as they are
        config.eval.lm_eval.tasks = [
            _resolved("eval.lm_eval.tasks", base / task)
            if task.endswith((".yaml", ".yml")) and _exists(base / task)
            else task
            for task in config.eval.lm_eval.tasks
        ]
    return config


def _exists(path: Path) -> bool:
    """Whether `path` exists, False where this user may not look (Path.exists raises there on Python 3.11)."""
    try:
        return path.exists()
    except OSError:
        return False


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read, override, validate. Raises ``UserError`` naming the file, line and key of each mistake."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the config
    except OSError as exc:
        raise UserError(f"{path}: cannot read config ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text; save the config as UTF-8") from None
    try:
        root = yaml.compose(text)
        _refuse_alias_bombs(root, path)
        tree = yaml.safe_load(text) or {}
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to read; is this a tuneforge config?") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UserError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(tree, dict):
        raise UserError(f"{path}: expected a mapping of sections (model, data, train, ...) at the top level")
    duplicates = _duplicate_keys(root)
    if duplicates:
        raise UserError(
            "\n".join(
                f"{path}:{again}: {key}: given twice (lines {first} and {again}); YAML would keep the last one "
                "silently: delete one"
                for key, first, again in duplicates
            )
        )

    overridden: dict[str, str] = {}
    for text_override in overrides:
        keys, value = parse_override(text_override)
        _set_dotted(tree, keys, value, text_override)
        overridden[".".join(keys)] = text_override

    try:
        config = Config.model_validate(tree)
    except ValidationError as exc:
        raise UserError(_format_errors(exc, path, root, overridden)) from None
    return _resolve_paths(config, path.parent)


def dump_config(config: Config, path: Path) -> None:
    """Write the resolved config; loading it again gives an equal ``Config``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json")
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One documented line per config key, for `tuneforge config-docs`."""
    lines = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        annotation = field.annotation
        candidates = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
        sections = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        doc = " ".join((field.description or "").split())
        if sections:
            lines.append(f"{dotted}: {doc}")
            lines.extend(describe_fields(sections[0], dotted + "."))
        else:
            default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
            lines.append(f"  {dotted} ({default}): {doc}")
    return lines
