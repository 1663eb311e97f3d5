"""Prompt templates with xtuner 0.1.x semantics, rendered into labelled text segments.

A template is SYSTEM (used once, only when the system text is non-empty), INSTRUCTION per user
turn, the reply followed by SUFFIX, then either the tokenizer's EOS token (unless
SUFFIX_AS_EOS) and SEP. A turn starts with BOS after an EOS, as xtuner does. The reply, its
suffix and its EOS are trained when the reply is; everything else is context.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuneforge.config.schema import TemplateConfig
from tuneforge.data.conversation import Conversation, Message
from tuneforge.errors import UserError


@dataclass(frozen=True)
class Template:
    system: str
    instruction: str
    suffix: str = ""
    suffix_as_eos: bool = False
    sep: str = ""
    stop_words: tuple[str, ...] = ()


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool
    special: bool = False
    """A special token given by its string (BOS/EOS): encoded alone, never merged with text."""


_DEEPSEEK_CODER_SYSTEM = (
    "You are an AI programming assistant, utilizing the DeepSeek Coder model, developed by "
    "DeepSeekCompany, and you only answer questions related to computer science. For politically "
    "sensitive questions, security and privacy issues, and other non-computer science questions, "
    "you will refuse to answer. {system}\n"
)

TEMPLATES: dict[str, Template] = {
    "deepseek_coder": Template(
        system=_DEEPSEEK_CODER_SYSTEM,
        instruction="### Instruction:\n{input}\n### Response:\n",
        sep="\n",
    ),
}


def get_template(spec: str | TemplateConfig) -> Template:
    """A built-in template by name, or a custom one from the config."""
    if isinstance(spec, TemplateConfig):
        return Template(**{**spec.model_dump(), "stop_words": tuple(spec.stop_words)})
    name = spec
    if name not in TEMPLATES:
        raise UserError(f"data.template: unknown template {name!r}; built-in: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[name]


def _turns(messages: tuple[Message, ...]) -> tuple[str, list[tuple[Message, Message | None]]]:
    has_system = bool(messages) and messages[0].role == "system"
    system = messages[0].content if has_system else ""
    body = messages[1:] if has_system else messages
    pairs = [(body[i], body[i + 1] if i + 1 < len(body) else None) for i in range(0, len(body), 2)]
    return system, pairs


def render(
    template: Template,
    conversation: Conversation,
    bos: str | None,
    eos: str,
    default_system: str | None = None,
    add_generation_prompt: bool = False,
) -> list[Segment]:
    """Segments of a whole conversation; with `add_generation_prompt` the final user turn is left open."""
    system, pairs = _turns(conversation.messages)
    system = system or (default_system or "")
    segments: list[Segment] = []
    needs_bos = True
    for index, (user, reply) in enumerate(pairs):
        if needs_bos and bos:
            segments.append(Segment(bos, trained=False, special=True))
        prompt = template.instruction.format(input=user.content, round=index + 1)
        if index == 0 and system:
            prompt = template.system.format(system=system) + prompt
        segments.append(Segment(prompt, trained=user.train))
        if reply is None:
            assert add_generation_prompt, "only a generation prompt may end on a user turn"
            break
        segments.append(Segment(reply.content + template.suffix, trained=reply.train))
        needs_bos = not template.suffix_as_eos
        if needs_bos:
            segments.append(Segment(eos, trained=reply.train, special=True))
        if template.sep:
            segments.append(Segment(template.sep, trained=False))
    return segments


def stop_strings(template: Template, eos: str) -> list[str]:
    return [eos, *template.stop_words]
