"""Text from files someone else may have written (a shared work dir, a dataset, a model's own replies), made safe
to show on a terminal: every reader that prints such text passes it through `safe_text` first."""

from __future__ import annotations


def _escapes() -> dict[int, str]:
    controls = [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0)]
    table = {code: f"\\x{code:02x}" for code in controls}
    # Lone surrogates (JSON's "\ud800") cannot be encoded: printing one would end the output with a traceback.
    table.update({code: f"\\u{code:04x}" for code in range(0xD800, 0xE000)})
    # Bidirectional overrides and isolates reorder what is shown around them (text that reads otherwise than it is).
    table.update({code: f"\\u{code:04x}" for code in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})
    return table


_ESCAPES = _escapes()


def safe_text(value: object) -> str:
    """`value` as text that is safe to show on a terminal: control characters (C0 but newline and tab, DEL, C1,
    so the ESC that starts every escape sequence) and bidirectional overrides become visible escapes such as
    `\\x1b`. Show the result as rich `Text` or plain print, never as markup."""
    try:
        text = value if isinstance(value, str) else str(value)
    except ValueError:  # an int too long to write out
        text = f"<{type(value).__name__}>"
    return text.translate(_ESCAPES)
