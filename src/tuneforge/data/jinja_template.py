"""An xtuner-style prompt template written as a Jinja `chat_template`, so exported models chat the way they
were trained in any tool that reads `tokenizer_config.json` (transformers, vLLM, TGI, llama.cpp).

The generated template follows `PromptTemplate.segments` exactly: a system message applies to the next user
turn, consecutive user messages are joined by a newline, BOS starts every turn after an EOS, and the default
system prompt of training applies to the first turn when the conversation has none.
"""

from __future__ import annotations

import json
import string

from tuneforge.data.templates import PromptTemplate


def literal(text: str) -> str:
    """`text` printed by a template action: a JSON string is a string literal to Jinja and to Go's text/template
    alike (the same escapes), and an action keeps the template's whitespace trimming off it."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}" if text else ""


def fill(pattern: str, fields: dict[str, str]) -> str:
    """A `str.format` pattern as template output (Jinja's or Go's): literal text, and each `{field}` as the given
    expression."""
    out = []
    for text, field, _spec, _conv in string.Formatter().parse(pattern):
        out.append(literal(text))
        if field is not None:
            out.append("{{ " + fields[field] + " }}")
    return "".join(out)


def to_jinja(template: PromptTemplate, default_system: str | None) -> str:
    system_block = fill(template.system, {"system": "system"})
    instruction = fill(template.instruction, {"input": "ns.pending", "round": "ns.round"})
    eos = "" if template.suffix_as_eos else "{{ eos_token }}"
    after_reply = "false" if template.suffix_as_eos else "true"
    return (
        "{%- set ns = namespace(bos=true, system='', pending='', round=0) -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] -%}"
        "{%- elif message['role'] == 'user' -%}"
        "{%- set ns.pending = ns.pending ~ '\\n' ~ message['content'] if ns.pending else message['content'] -%}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'user' -%}"
        "{%- set ns.round = ns.round + 1 -%}"
        "{%- if ns.bos and bos_token -%}{{ bos_token }}{%- endif -%}"
        "{%- set system = ns.system if ns.system else (" + json.dumps(default_system or "") + " if ns.round == 1 "
        "else '') -%}"
        "{%- if system -%}" + system_block + "{%- endif -%}" + instruction + ""
        "{%- set ns.system = '' -%}{%- set ns.pending = '' -%}"
        "{%- endif -%}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{ message['content'] }}" + literal(template.suffix) + eos + literal(template.sep) + ""
        "{%- set ns.bos = " + after_reply + " -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )
