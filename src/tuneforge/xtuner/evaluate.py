"""Read an xtuner 0.1.x (mmengine-style) Python config without executing it.

The module's statements are walked with `ast`: assignments of literals, lists, dicts, `dict(...)` calls, names
of earlier assignments, attribute paths (`PROMPT_TEMPLATE.deepseek_coder`, `torch.float16`), arithmetic, and
`if` blocks whose condition can be decided. Imported names stay symbols (`Symbol("transformers.AutoTokenizer")`):
nothing is imported, so neither xtuner nor mmengine is needed. Every value remembers its line for reports.
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.errors import UserError


@dataclass(frozen=True)
class Symbol:
    """An imported name or an attribute of one, kept by its dotted path."""

    path: str

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass
class Call:
    """`dict(type=X, a=1)` or `X(a=1)`: the type (if any), the keyword fields and their lines."""

    type: Any
    fields: dict[str, Any]
    lines: dict[str, int]
    line: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


@dataclass
class Module:
    values: dict[str, Any] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """Statements that could not be read: (line, why)."""


class Unknown(Exception):
    """An expression outside the readable subset."""


BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


class Reader:
    def __init__(self, module: Module):
        self.module = module
        self.symbols: dict[str, Symbol] = {}

    def value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.value(item) for item in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.Dict):
            if any(key is None for key in node.keys):
                raise Unknown("dict unpacking")
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values, strict=True)}
        if isinstance(node, ast.Name):
            if node.id in self.module.values:
                return self.module.values[node.id]
            if node.id in self.symbols:
                return self.symbols[node.id]
            if node.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.id]
            raise Unknown(f"name {node.id!r} is not defined above")
        if isinstance(node, ast.Attribute):
            base = self.value(node.value)
            if isinstance(base, Symbol):
                return Symbol(f"{base.path}.{node.attr}")
            raise Unknown(f"attribute {node.attr!r} of a value")
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return BINARY[type(node.op)](self.value(node.left), self.value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = self.value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.Call):
            if node.args:
                raise Unknown("positional arguments in a call")
            if any(kw.arg is None for kw in node.keywords):
                raise Unknown("**kwargs in a call")
            function = self.value(node.func)
            fields = {kw.arg: self.value(kw.value) for kw in node.keywords}
            lines = {kw.arg: kw.value.lineno for kw in node.keywords}
            if isinstance(function, Symbol) and function.path == "dict":
                return Call(fields.pop("type", None), fields, lines, node.lineno)
            return Call(function, fields, lines, node.lineno)
        raise Unknown(type(node).__name__)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self.symbols[alias.asname or alias.name.split(".")[0]] = Symbol(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                self.symbols[alias.asname or alias.name] = Symbol(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            self._assign([t.id for t in node.targets], node.value, node.lineno)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            combined = ast.BinOp(left=ast.Name(id=name, ctx=ast.Load()), op=node.op, right=node.value)
            self._assign([name], ast.copy_location(combined, node), node.lineno)
        elif isinstance(node, ast.If):
            try:
                taken = bool(self.value(node.test))
            except Unknown as exc:
                self.module.skipped.append((node.lineno, f"`if` whose condition cannot be decided ({exc})"))
                return
            for inner in node.body if taken else node.orelse:
                self.statement(inner)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # a docstring
        else:
            self.module.skipped.append((node.lineno, f"{type(node).__name__} statements are not read"))

    def _assign(self, names: list[str], value: ast.expr, line: int) -> None:
        try:
            result = self.value(value)
        except (Unknown, TypeError, ZeroDivisionError) as exc:
            self.module.skipped.append((line, f"`{names[0]} = ...` cannot be read without running it ({exc})"))
            return
        for name in names:
            self.module.values[name] = result
            self.module.lines[name] = line


def read_config(path: Path) -> Module:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read the xtuner config ({exc})") from None
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        source = (exc.text or "").strip()
        raise UserError(
            f"{path}:{exc.lineno}: not valid Python ({exc.msg}): {source!r}. An xtuner config is a Python file: "
            "fix that line (a placeholder such as [数据地址] must become a quoted path, e.g. ['data/train.jsonl'])"
        ) from None
    module = Module()
    reader = Reader(module)
    reader.symbols["dict"] = Symbol("dict")
    for node in tree.body:
        reader.statement(node)
    return module
