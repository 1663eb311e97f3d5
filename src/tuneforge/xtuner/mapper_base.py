"""What every part of an xtuner config's mapping shares: the result, the bookkeeping of what was and was
not mapped (with lines), and reading plain values, xtuner's templates included. See `mapping`."""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.data.templates import BUILT_IN
from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import Call, Module, Symbol, read_config

TEMPLATE_SYMBOL = re.compile(r"xtuner\.utils(?:\.templates)?\.(SYSTEM_TEMPLATE|PROMPT_TEMPLATE)\.(\w+)")
TEMPLATE_KEYS = {
    "SYSTEM": "system",
    "INSTRUCTION": "instruction",
    "SUFFIX": "suffix",
    "SUFFIX_AS_EOS": "suffix_as_eos",
    "SEP": "sep",
    "STOP_WORDS": "stop_words",
}
"""xtuner PROMPT_TEMPLATE keys and the inline `data.template` fields with the same meaning."""
NO_XTUNER = "its text is in xtuner's package, not installed here: pip install xtuner==0.1.23 --no-deps, or set {}"
NOT_NEEDED = {
    "remove_unused_columns": "tuneforge keeps only what it tokenizes",
    "padding_side": "tuneforge pads on the right",
    "task_type": "always a causal language model",
    "collate_fn": "tuneforge collates with minimal padding itself",
    "sampler": "tuneforge shuffles by seed and epoch and shards per rank itself",
    "num_workers": "tuneforge prepares and caches tokenized data up front; no loader workers are needed",
    "pin_memory": "tuneforge moves each batch to the device itself",
    "use_varlen_attn": "packed samples are always isolated (per-sample SDPA, eager with a block mask, flash varlen)",
    "shuffle_before_pack": "tuneforge packs with best-fit decreasing and shuffles the packed rows every epoch",
    "llm_int8_threshold": "bitsandbytes default (6.0)",
    "llm_int8_has_fp16_weight": "bitsandbytes default (False)",
    "load_in_8bit": "read together with load_in_4bit",
    "error_if_nonfinite": "tuneforge skips and reports non-finite steps (train.max_nonfinite_steps)",
    "convert_to_iter_based": "tuneforge schedules by optimizer step",
    "by_epoch": "tuneforge schedules by optimizer step",
}


@dataclass
class Imported:
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    """Conversions worth reading (iterations to steps, dtype choices)."""
    unmapped: list[tuple[int, str, str]] = field(default_factory=list)
    """(line, what, why) for everything that has no tuneforge equivalent."""
    launch: str = ""


def type_name(value: Any) -> str:
    if isinstance(value, Symbol):
        return value.name
    if isinstance(value, Call):
        return type_name(value.type) if value.type is not None else "dict"
    return value if isinstance(value, str) else type(value).__name__


def shown(value: Any) -> str:
    """A short rendering for report lines: dotted paths for symbols, `Type(...)` for calls."""
    if isinstance(value, Symbol):
        return value.path
    if isinstance(value, Call):
        return f"{type_name(value)}({', '.join(value.fields)})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _xtuner_templates() -> dict[str, Call] | None:
    """xtuner's own utils/templates.py where xtuner is installed, read by the safe reader: never imported.

    `find_spec` of a top-level package only locates it; its `__init__` is not run. None without xtuner.
    """
    try:
        spec = importlib.util.find_spec("xtuner")
    except (ImportError, ValueError):  # ValueError: a half-initialised module in sys.modules
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "utils" / "templates.py"
        if path.is_file():
            return _read_templates(path, path.stat().st_mtime_ns)
    return None


@functools.lru_cache(maxsize=8)
def _read_templates(path: Path, mtime_ns: int) -> dict[str, Call]:
    """The `NAME = ConfigDict(...)` tables of a templates.py (mtime_ns keys the cache to the file's version)."""
    try:
        module = read_config(path)
    except UserError:
        return {}
    return {name: value for name, value in module.values.items() if isinstance(value, Call)}


class Unresolved(Exception):
    """A value reached through xtuner that cannot be carried over; the message says why."""


def plain_value(value: Any, where: str, line: int, origins: dict[int, int], unmapped: list) -> tuple[bool, Any]:
    """(ok, value) with tuples as lists; anything YAML cannot hold as plain data is listed as unmapped."""
    line = origins.get(id(value), line)
    if value is None or isinstance(value, (str, bool, int, float)):
        return True, value
    if isinstance(value, (list, tuple)):
        items = [plain_value(item, f"{where}[{i}]", line, origins, unmapped) for i, item in enumerate(value)]
        # A list missing an element would mean something else (fewer files, other betas): all or nothing.
        return all(ok for ok, _ in items), [item for _, item in items]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        entries = {key: plain_value(item, f"{where}.{key}", line, origins, unmapped) for key, item in value.items()}
        return True, {key: item for key, (ok, item) in entries.items() if ok}
    unmapped.append((line, f"{where} = {shown(value)}", "an xtuner or Python object, not a value tuneforge can hold"))
    return False, None


def dtype_name(value: Any) -> str | None:
    name = type_name(value).removeprefix("torch.")
    return {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32"}.get(name)


class MapperBase:
    """The state and the helpers of one mapping; `Mapper` combines the parts that use them."""

    def __init__(self, module: Module, config_path: Path):
        self.module = module
        self.path = config_path
        self.result = Imported(config={"model": {}, "data": {}, "train": {}, "parallel": {}, "checkpoint": {}})
        self.used: set[tuple[int, str]] = set()
        self.origins: dict[int, int] = {}
        """id(value) -> the line it was read from, for locating values found unusable only at the end."""
        self.stage = "model"
        """The section being mapped, named when an unexpected value stops the mapping."""

    # -- helpers ---------------------------------------------------------------------------------------------
    def section(self, name: str) -> dict[str, Any]:
        return self.result.config.setdefault(name, {})

    def take(self, call: Call | None, key: str) -> Any:
        if not isinstance(call, Call) or key not in call.fields:
            return None
        self.used.add((id(call), key))
        value = call.fields[key]
        self.origins.setdefault(id(value), call.lines.get(key, call.line))
        return value

    def line(self, call: Call, key: str) -> int:
        return call.lines.get(key, call.line)

    def number(self, call: Call | None, key: str, where: str) -> int | float | None:
        """A numeric field, or None (listed as unmapped) when it is something the reader kept as a symbol or text."""
        value = self.take(call, key)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return value
        assert isinstance(call, Call)
        self.unmapped(self.line(call, key), f"{where}.{key} = {shown(value)}", "not a number")
        return None

    def strings(self, value: Any, line: int, what: str, fix: str) -> list[str] | None:
        """One string or a list of them, as a list; anything else is listed as unmapped with `fix`."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            return list(value)
        self.unmapped(line, f"{what} = {shown(value)}", f"not a string or a list of strings; {fix}")
        return None

    def xtuner_value(self, value: Any, setting: str) -> Any:
        """`SYSTEM_TEMPLATE.x` / `PROMPT_TEMPLATE.x` read from xtuner's installed templates.py; other values as is."""
        if not isinstance(value, Symbol):
            return value
        match = TEMPLATE_SYMBOL.fullmatch(value.path)
        if match is None:
            raise Unresolved(f"{value.path} is code, not a value; set {setting}")
        tables = _xtuner_templates()
        if tables is None:
            raise Unresolved(NO_XTUNER.format(setting))
        table = tables.get(match[1])
        if table is None or match[2] not in table.fields:
            raise Unresolved(f"the installed xtuner has no {match[1]}.{match[2]}; set {setting}")
        return table.fields[match[2]]

    def text(self, value: Any, line: int, what: str, setting: str) -> str | None:
        """A text setting (a system prompt) resolved through xtuner's templates, or None and an unmapped line."""
        try:
            value = self.xtuner_value(value, setting)
        except Unresolved as exc:
            self.unmapped(line, f"{what} = {shown(value)}", str(exc))
            return None
        if not isinstance(value, str):
            self.unmapped(line, f"{what} = {shown(value)}", f"not a text; set {setting}")
            return None
        return value

    def template(self, value: Any, line: int) -> str | dict[str, Any] | None:
        """A tuneforge built-in template of the same name, else the xtuner template's fields as an inline one."""
        if isinstance(value, Symbol) and value.name in BUILT_IN:
            return value.name
        try:
            fields = self.xtuner_value(value, "data.template")
        except Unresolved as exc:
            self.unmapped(line, f"prompt template {shown(value)}", str(exc))
            return None
        if isinstance(fields, Call) and fields.type is None:
            fields = fields.fields
        if not isinstance(fields, dict) or not fields:
            self.unmapped(line, f"prompt template {shown(value)}", "not a template; set data.template")
            return None
        inline = {TEMPLATE_KEYS[k]: v for k, v in fields.items() if k in TEMPLATE_KEYS}
        for key in fields.keys() - TEMPLATE_KEYS.keys():
            self.unmapped(line, f"prompt template {shown(value)}: {key}", "no tuneforge template field")
        if isinstance(value, Symbol):
            self.result.notes.append(f"{value.path}: not built in; its fields read from xtuner's templates.py")
        return inline

    def skip(self, call: Call, key: str) -> None:
        self.used.add((id(call), key))

    def unmapped(self, line: int, what: str, why: str) -> None:
        self.result.unmapped.append((line, what, why))

    def leftovers(self, call: Call, where: str) -> None:
        """Fields of `call` nothing took: explained when known not to be needed, else listed as unmapped."""
        for key, value in call.fields.items():
            if (id(call), key) in self.used:
                continue
            if key in NOT_NEEDED:
                continue
            self.unmapped(self.line(call, key), f"{where}.{key} = {shown(value)}", "no tuneforge equivalent")

    def iterations_to_steps(self, iterations: int, accumulation: int, what: str) -> int:
        steps = max(1, round(iterations / accumulation))
        self.result.notes.append(
            f"{what}: {iterations} iterations / accumulative_counts {accumulation} = "
            f"{iterations / accumulation:g} optimizer steps -> {steps}"
        )
        return steps

    # -- sections --------------------------------------------------------------------------------------------
