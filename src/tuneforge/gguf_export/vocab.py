"""A Hugging Face byte-level BPE tokenizer as llama.cpp's `gpt2` vocabulary, the same token for token.

llama.cpp re-implements pre-tokenization (the regex split before BPE merges) per named scheme. The scheme is
found here by behaviour: a probe text is split by the tokenizer's own pre-tokenizer and by each scheme's
expressions, and the scheme must agree on every piece. A tokenizer that matches none is refused: a wrong split
changes token ids silently, the classic cause of a GGUF that "answers garbage".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import gguf
import regex

from tuneforge.errors import UserError

SCHEMES: dict[str, tuple[str, ...]] = {
    "gpt-2": (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",),
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ),
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}
"""llama.cpp pre-tokenizer name -> the regular expressions it splits with, applied one after another (each
splits every piece of the previous into its matches and the text between them)."""

PROBE = (
    "Hello world! It's 2026; we'll test THE tokenizer's edge-cases: 1234567 + 89 = 1234656.\n\n"
    "  Indented    spaces\tand\ttabs\r\nWindows line\n\n\nThree blank lines   \n"
    "Ünïcödé façade naïve café — “quotes” ‘single’ … €100 ¥200\n"
    "中文分词测试，标点符号。日本語のテキスト、カタカナ。한국어 문장입니다.\n"
    "def f(x):\n    return x**2  # comment\n\tif a!=b and c>=d: pass\n"
    "emoji 🙂🚀 and combining e\u0301 marks; URL https://example.com/a?b=c&d=e\n"
    "CamelCaseWords snake_case_words ALLCAPS MixedUP iPhone 3.14159 0x1F 1,000,000\n"
    "I'M YOU'RE they'LL we'D Shouldn't\n"
)


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scheme: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    eot_id: int | None = None
    """The chat template's end-of-turn token, where it has one besides the EOS (llama.cpp stops at both)."""


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level(text: str) -> str:
    alphabet = _byte_alphabet()
    return "".join(alphabet[byte] for byte in text.encode("utf-8"))


def split_with(expressions: tuple[str, ...], text: str) -> list[str]:
    pieces = [text]
    for expression in expressions:
        pattern = regex.compile(expression)
        next_pieces = []
        for piece in pieces:
            start = 0
            for match in pattern.finditer(piece):
                if match.start() > start:
                    next_pieces.append(piece[start : match.start()])
                if match.end() > match.start():
                    next_pieces.append(match.group())
                start = match.end()
            if start < len(piece):
                next_pieces.append(piece[start:])
        pieces = next_pieces
    return pieces


def _own_split(tokenizer: Any, text: str) -> list[str]:
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    if backend.pre_tokenizer is None:
        return [_byte_level(text)]
    return [piece for piece, _span in backend.pre_tokenizer.pre_tokenize_str(text)]


def pre_tokenizer_scheme(tokenizer: Any, has_merges: bool) -> str:
    """The llama.cpp scheme that splits text as `tokenizer` does; any scheme when there are no merges (every
    split then gives the same byte tokens)."""
    if not has_merges:
        return "gpt-2"
    own = _own_split(tokenizer, PROBE)
    for scheme, expressions in SCHEMES.items():
        if [_byte_level(piece) for piece in split_with(expressions, PROBE)] == own:
            return scheme
    raise UserError(
        "export --format gguf: this tokenizer splits text before BPE in a way none of llama.cpp's pre-tokenizers "
        f"that tuneforge knows ({', '.join(SCHEMES)}) reproduces; writing it would change token ids. Export "
        "--merge and convert with llama.cpp's convert_hf_to_gguf.py, which knows more"
    )


def _check_byte_level(spec: dict) -> None:
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "SentencePiece-style" if model.get("byte_fallback") else str(model.get("type"))
        raise UserError(
            f"export --format gguf: the tokenizer is a {kind} one; tuneforge writes byte-level BPE vocabularies "
            "(Llama 3, Qwen, DeepSeek, Mistral's Tekken). Export --merge and convert with llama.cpp's "
            "convert_hf_to_gguf.py"
        )
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise UserError(
            f"export --format gguf: the tokenizer normalises text ({normalizer.get('type')}), which llama.cpp's "
            "byte-level vocabularies do not"
        )


INERT_MERGE = "[no-merges] [no-merges]"
"""llama.cpp refuses a BPE vocabulary without merges, and GGUF has no empty arrays: a vocabulary of bytes alone
(tuneforge's byte tokenizer) gets this one merge, which never applies (symbols start as single characters and no
other merge builds a longer one)."""


def _merges(spec: dict) -> list[str]:
    return [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"].get("merges", [])]


def _adds(tokenizer: Any, token_id: int | None) -> tuple[bool, bool]:
    probe = "x"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    add_bos = token_id is not None and len(full) > len(plain) and full[0] == tokenizer.bos_token_id
    add_eos = len(full) > len(plain) and full[-1] == tokenizer.eos_token_id
    return add_bos, add_eos


def vocabulary(tokenizer: Any, rows: int) -> Vocabulary:
    """The tokenizer as llama.cpp lists it, padded to the embedding's `rows`."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError("export --format gguf: the tokenizer has no tokenizer.json (a slow tokenizer)")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    _check_byte_level(spec)
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if len(by_id) > rows:
        raise UserError(f"export --format gguf: the tokenizer has {len(by_id)} tokens, the embedding {rows} rows")
    added = {entry["id"]: entry for entry in spec.get("added_tokens", [])}
    tokens, types = [], []
    for index in range(rows):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(added[index]["content"])
            types.append(gguf.TokenType.CONTROL if added[index]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    merges = _merges(spec)
    add_bos, add_eos = _adds(tokenizer, tokenizer.bos_token_id)
    return Vocabulary(
        tokens=tokens,
        types=[int(kind) for kind in types],
        merges=merges,
        scheme=pre_tokenizer_scheme(tokenizer, bool(merges)),
        bos_id=tokenizer.bos_token_id,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        unk_id=tokenizer.unk_token_id,
        add_bos=add_bos,
        add_eos=add_eos,
    )


def write_vocabulary(writer: gguf.GGUFWriter, vocab: Vocabulary) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.scheme)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges or [INERT_MERGE])
    for setter, value in (
        (writer.add_bos_token_id, vocab.bos_id),
        (writer.add_eos_token_id, vocab.eos_id),
        (writer.add_eot_token_id, vocab.eot_id),
        (writer.add_pad_token_id, vocab.pad_id),
        (writer.add_unk_token_id, vocab.unk_id),
    ):
        if value is not None:
            setter(value)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
