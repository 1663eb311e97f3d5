"""Read an xtuner 0.1.x (mmengine-style) Python config without executing it.

The module's statements are walked with `ast`: assignments of literals, lists, dicts, `dict(...)` calls, names
of earlier assignments, attribute paths (`PROMPT_TEMPLATE.deepseek_coder`, `torch.float16`), arithmetic,
comparisons, `A if cond else B`, `int(x)` / `float(x)` of a plain value (gallery configs write
`max_length = int(2048 - (336 / 14)**2)`) and `if` blocks whose condition can be decided without running anything.
Imported names stay symbols (`Symbol("transformers.AutoTokenizer")`): nothing is imported, so neither xtuner
nor mmengine is needed. Every value remembers its line for reports.
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
    """An expression outside the readable subset; `field` and `line` say where inside a `dict(...)` it was."""

    def __init__(self, why: str, field: str = "", line: int | None = None):
        self.why, self.field, self.line = why, field, line
        where = f"field {field} (line {line}): " if field else ""
        super().__init__(where + why)


READ_ERRORS = (Unknown, TypeError, ValueError, ArithmeticError, RecursionError)
"""What reading one expression may raise: that statement is then skipped and reported, never the whole file."""
REPEAT_LIMIT = 1_000_000
"""`'x' * n`, `[a] * n` or a sum of sequences past this many items is refused rather than built (a config has
no use for it)."""
INT_BITS_LIMIT = 4096
"""An integer result beyond this many bits is refused rather than computed: squaring a number 40 times takes
the reader's whole memory, and no config needs such a number."""


BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
CONVERSIONS = {"int": int, "float": float}
"""Built-in conversions read when called on one plain number or text (and not redefined by the config)."""
COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
PLAIN = (str, int, float, bool, type(None), list, tuple, dict)
"""Values a condition may compare: a symbol's truth or identity is only known when the code runs."""


def _refuse_huge(op: ast.operator, left: Any, right: Any) -> None:
    """Results too large to be a setting, refused before they are built."""
    integers = isinstance(left, int) and isinstance(right, int)
    if integers and isinstance(op, ast.Pow) and right > 0 and left.bit_length() * right > INT_BITS_LIMIT:
        raise Unknown(f"a number of more than {INT_BITS_LIMIT} bits")
    if (
        integers
        and isinstance(op, ast.Mult | ast.Add | ast.Sub)
        and left.bit_length() + right.bit_length() > INT_BITS_LIMIT
    ):
        raise Unknown(f"a number of more than {INT_BITS_LIMIT} bits")
    sequences = isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple)
    if sequences and isinstance(op, ast.Add) and len(left) + len(right) > REPEAT_LIMIT:
        raise Unknown("a sequence too large to build")


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
            left, right = self.value(node.left), self.value(node.right)
            if isinstance(node.op, ast.Mult) and any(
                isinstance(a, (str, list, tuple)) and isinstance(b, int) and b * len(a) > REPEAT_LIMIT
                for a, b in ((left, right), (right, left))
            ):
                raise Unknown("a repetition too large to build")
            _refuse_huge(node.op, left, right)
            return BINARY[type(node.op)](left, right)
        if isinstance(node, ast.IfExp):  # `A if cond else B`: gallery configs choose their sampler so
            return self.value(node.body if self.condition(node.test) else node.orelse)
        if isinstance(node, ast.BoolOp):  # Python's own: the first value that decides, not a bool
            for item in node.values[:-1]:
                value = self.plain(item)
                if bool(value) is isinstance(node.op, ast.Or):
                    return value
            return self.value(node.values[-1])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.plain(node.operand)
        if isinstance(node, ast.Compare):
            left = self.plain(node.left)
            for op, right_node in zip(node.ops, node.comparators, strict=True):
                right = self.plain(right_node)
                if not COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = self.value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.Call):
            if self._conversion(node):
                return self._convert(node)
            if node.args:
                raise Unknown("positional arguments in a call")
            if any(kw.arg is None for kw in node.keywords):
                raise Unknown("**kwargs in a call")
            function = self.value(node.func)
            fields = {kw.arg: self._field(kw) for kw in node.keywords}
            lines = {kw.arg: kw.value.lineno for kw in node.keywords}
            if isinstance(function, Symbol) and function.path == "dict":
                return Call(fields.pop("type", None), fields, lines, node.lineno)
            return Call(function, fields, lines, node.lineno)
        raise Unknown(type(node).__name__)

    def _conversion(self, node: ast.Call) -> bool:
        """`int(x)` or `float(x)` with the built-in meaning: the name not defined by the config itself."""
        name = node.func.id if isinstance(node.func, ast.Name) else None
        return name in CONVERSIONS and name not in self.module.values and name not in self.symbols

    def _convert(self, node: ast.Call) -> Any:
        name = node.func.id  # type: ignore[attr-defined]  # checked by _conversion
        if len(node.args) != 1 or node.keywords or isinstance(node.args[0], ast.Starred):
            raise Unknown(f"{name}() with other than one argument")
        value = self.plain(node.args[0])
        if not isinstance(value, (int, float, str)):
            raise Unknown(f"{name}() of a {type(value).__name__}")
        return CONVERSIONS[name](value)

    def _field(self, keyword: ast.keyword) -> Any:
        try:
            return self.value(keyword.value)
        except Unknown as exc:  # named by its path inside the dict, the innermost line kept
            inner = f"{keyword.arg}.{exc.field}" if exc.field else keyword.arg
            raise Unknown(exc.why, inner, exc.line or keyword.value.lineno) from None

    def condition(self, node: ast.expr) -> bool:
        return bool(self.plain(node))

    def plain(self, node: ast.expr) -> Any:
        """A value whose truth and comparisons are known now; Unknown for an imported object's."""
        value = self.value(node)
        if not isinstance(value, PLAIN):
            raise Unknown(f"the truth of {getattr(value, 'path', type(value).__name__)} is known only at run time")
        return value

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
                taken = self.condition(node.test)
            except READ_ERRORS as exc:
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
        except READ_ERRORS as exc:
            self.module.skipped.append((line, f"`{names[0]} = ...` cannot be read without running it ({exc})"))
            return
        for name in names:
            self.module.values[name] = result
            self.module.lines[name] = line


CONFIG_BYTES_LIMIT = 16 * 2**20
"""xtuner configs are a few KB; a larger file is not one (and /dev/zero would be read until memory runs out)."""


def read_config(path: Path) -> Module:
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: not a regular file (a directory, device or pipe); give the xtuner config, a .py file")
    if path.exists() and path.stat().st_size > CONFIG_BYTES_LIMIT:
        raise UserError(
            f"{path}: {path.stat().st_size:,} bytes, more than an xtuner config holds ({CONFIG_BYTES_LIMIT:,} at most)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read the xtuner config ({exc})") from None
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: not a text file (byte {exc.object[exc.start]:#04x} at offset {exc.start} is not UTF-8); "
            "give the xtuner config, a Python .py file"
        ) from None
    if "\0" in text:  # ast.parse would refuse it with a bare ValueError
        raise UserError(f"{path}: contains NUL bytes, so it is a binary file, not an xtuner config (.py)")
    try:
        tree = ast.parse(text, filename=str(path))
    except (RecursionError, MemoryError):
        raise UserError(f"{path}: nested too deeply to read; is this an xtuner config?") from None
    except SyntaxError as exc:
        source = (exc.text or "").strip()
        source = source if len(source) <= 120 else source[:120] + "..."
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
