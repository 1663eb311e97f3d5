"""An Ollama Modelfile that prompts the model exactly as training did.

Ollama renders prompts with Go's text/template over `.Messages`, not with the GGUF's Jinja template, so the
training template is written a second time in Go's syntax. It follows `PromptTemplate.segments` as the Jinja
form does (`data/jinja_template.py`): a system message applies to the next user turn, consecutive user messages
join with a newline, BOS starts a turn after an EOS, the default system prompt applies to the first turn. The
round counter is a string grown by one letter per turn (Go templates have no arithmetic; `len` counts it).
"""

from __future__ import annotations

import json

from tuneforge.data.jinja_template import fill, literal
from tuneforge.data.templates import PromptTemplate


def go_template(template: PromptTemplate, bos: str | None, eos: str, default_system: str | None) -> str:
    instruction = fill(template.instruction, {"input": "$pending", "round": "len $rounds"})
    system_block = fill(template.system, {"system": "$turn_system"})
    bos_part = "{{- if $bos }}" + literal(bos) + "{{- end }}" if bos else ""
    flush = (
        '{{- $rounds = printf "%sx" $rounds }}' + bos_part + "{{- $turn_system := $system }}"
        "{{- if not $turn_system }}{{- if eq (len $rounds) 1 }}{{- $turn_system = "
        + json.dumps(default_system or "", ensure_ascii=False)
        + " }}{{- end }}{{- end }}"
        "{{- if $turn_system }}" + system_block + "{{- end }}" + instruction + ""
        '{{- $system = "" }}{{- $pending = "" }}'
    )
    eos_part = "" if template.suffix_as_eos else literal(eos)
    after_reply = "false" if template.suffix_as_eos else "true"
    return (
        '{{- $bos := true }}{{- $system := "" }}{{- $pending := "" }}{{- $rounds := "" }}'
        "{{- range .Messages }}"
        '{{- if eq .Role "user" }}'
        '{{- if $pending }}{{- $pending = printf "%s\\n%s" $pending .Content }}{{- else }}'
        "{{- $pending = .Content }}{{- end }}"
        "{{- else }}"
        "{{- if $pending }}" + flush + "{{- end }}"
        '{{- if eq .Role "system" }}{{- $system = .Content }}'
        '{{- else if eq .Role "assistant" }}{{ .Content }}'
        + literal(template.suffix)
        + eos_part
        + literal(template.sep)
        + "{{- $bos = "
        + after_reply
        + " }}"
        "{{- end }}"
        "{{- end }}"
        "{{- end }}"
        "{{- if $pending }}" + flush + "{{- end }}"
    )


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def modelfile(gguf_name: str, template: str | None, stops: list[str]) -> str:
    """The Modelfile text: FROM the GGUF beside it, the Go template (when the run's template is tuneforge's;
    otherwise Ollama reads the GGUF's own Jinja template), and a stop parameter per stop string."""
    lines = [f"FROM ./{gguf_name}"]
    if template is not None:
        if '"""' in template:
            raise ValueError("the chat template contains a triple quote, which a Modelfile cannot hold")
        lines.append(f'TEMPLATE """{template}"""')
    for stop in dict.fromkeys(stop for stop in stops if stop):
        lines.append(f"PARAMETER stop {_quoted(stop)}")
    return "\n".join(lines) + "\n"
