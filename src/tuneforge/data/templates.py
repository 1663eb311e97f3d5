"""Chat templates: xtuner 0.1.x prompt formats, and the tokenizer's own Jinja `chat_template`.

Both turn a ``Conversation`` into token ids, labels (-100 for untrained tokens) and the token
index where each turn ends (for truncation at turn boundaries).

xtuner semantics, reproduced exactly: a turn is SYSTEM (only when the system text is non-empty)
+ INSTRUCTION (with `{input}` and `{round}`), then the reply + SUFFIX, then the tokenizer's EOS
unless SUFFIX_AS_EOS, then SEP. BOS starts the first turn and every turn after an EOS. Prompt
parts are encoded separately from replies, as xtuner does. The reply, its suffix and its EOS
are trained when the reply is; everything else is context.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from tuneforge.config.schema import TemplateConfig
from tuneforge.data.conversation import Conversation
from tuneforge.errors import UserError

IGNORE_INDEX = -100


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    turn_ends: list[int] = field(default_factory=list)
    """Token index just after each complete turn (including its separator)."""


class ChatTemplate(Protocol):
    def encode(
        self, conversations: list[Conversation], tokenizer: PreTrainedTokenizerBase, default_system: str | None
    ) -> list[Encoded]: ...

    def render(self, conversation: Conversation, tokenizer: PreTrainedTokenizerBase, default_system: str | None) -> str:
        """The text the model sees (a generation prompt when the last turn has no reply)."""
        ...

    def prompt_ids(
        self, conversation: Conversation, tokenizer: PreTrainedTokenizerBase, default_system: str | None
    ) -> list[int]:
        """Token ids of a conversation whose last turn is open, ending where the reply starts."""
        ...

    def stop_strings(self, tokenizer: PreTrainedTokenizerBase) -> list[str]: ...


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool
    special: bool = False
    """BOS/EOS given by their token string: encoded as that one token, never merged with text."""
    turn: int = 0


@dataclass(frozen=True)
class PromptTemplate:
    """An xtuner-style template (SYSTEM, INSTRUCTION, SUFFIX, SUFFIX_AS_EOS, SEP, STOP_WORDS)."""

    system: str
    instruction: str
    suffix: str = ""
    suffix_as_eos: bool = False
    sep: str = ""
    stop_words: tuple[str, ...] = ()

    def segments(self, conversation: Conversation, tokenizer: PreTrainedTokenizerBase, default_system: str | None):
        bos, eos = tokenizer.bos_token, tokenizer.eos_token
        out: list[Segment] = []
        needs_bos = True
        for index, turn in enumerate(conversation.turns):
            if needs_bos and bos:
                out.append(Segment(bos, False, special=True, turn=index))
            system = turn.system or (default_system if index == 0 else "") or ""
            prompt = self.instruction.format(input=turn.user, round=index + 1)
            if system:
                prompt = self.system.format(system=system) + prompt
            out.append(Segment(prompt, False, turn=index))
            if turn.assistant is None:
                break
            out.append(Segment(turn.assistant + self.suffix, turn.train, turn=index))
            needs_bos = not self.suffix_as_eos
            if needs_bos:
                out.append(Segment(eos, turn.train, special=True, turn=index))
            if self.sep:
                out.append(Segment(self.sep, False, turn=index))
        return out

    def encode(self, conversations, tokenizer, default_system):
        all_segments = [self.segments(c, tokenizer, default_system) for c in conversations]
        texts = [s.text for segs in all_segments for s in segs if not s.special]
        pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        results = []
        for segments in all_segments:
            encoded = Encoded([], [])
            for index, segment in enumerate(segments):
                ids = [tokenizer.convert_tokens_to_ids(segment.text)] if segment.special else next(pieces)
                encoded.input_ids.extend(ids)
                encoded.labels.extend(ids if segment.trained else [IGNORE_INDEX] * len(ids))
                if index + 1 == len(segments) or segments[index + 1].turn != segment.turn:
                    encoded.turn_ends.append(len(encoded.input_ids))
            results.append(encoded)
        return results

    def render(self, conversation, tokenizer, default_system):
        return "".join(s.text for s in self.segments(conversation, tokenizer, default_system))

    def prompt_ids(self, conversation, tokenizer, default_system):
        return self.encode([conversation], tokenizer, default_system)[0].input_ids

    def stop_strings(self, tokenizer):
        return [tokenizer.eos_token, *self.stop_words]


class TokenizerTemplate:
    """The tokenizer's Jinja `chat_template`. Trained spans are found by rendering: the reply of turn k is the
    text between the rendering of turns < k with a generation prompt and the rendering of turns <= k."""

    def _messages(self, conversation: Conversation, default_system: str | None) -> list[dict[str, str]]:
        messages = conversation.messages()
        if default_system and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": default_system})
        return messages

    def _apply(self, tokenizer, messages, generation_prompt: bool) -> str:
        import jinja2

        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except jinja2.TemplateError as exc:  # a syntax error, or the sandbox refusing what the template tried
            raise UserError(
                f"the tokenizer's chat_template cannot be rendered ({type(exc).__name__}: {exc}); fix it in "
                "tokenizer_config.json, or name a built-in template (data.template, or --template for chat)"
            ) from None

    def _spans(self, conversation, tokenizer, default_system) -> tuple[str, list[tuple[int, int, bool]]]:
        messages = self._messages(conversation, default_system)
        full = self._apply(tokenizer, messages, generation_prompt=False)
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._apply(tokenizer, messages[:index], generation_prompt=True)
            through = self._apply(tokenizer, messages[: index + 1], generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise UserError(
                    "data.template=tokenizer: this chat_template does not render a conversation as the extension of "
                    "its prefix (it rewrites earlier turns), so reply spans cannot be found by rendering; "
                    "use a built-in template instead"
                )
            spans.append((len(before), len(through), self._train_flag(conversation, message, index, messages)))
        return full, spans

    @staticmethod
    def _train_flag(conversation: Conversation, message: dict, index: int, messages: list[dict]) -> bool:
        reply_number = sum(1 for m in messages[:index] if m["role"] == "assistant")
        return conversation.turns[reply_number].train

    def encode(self, conversations, tokenizer, default_system):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("data.template=tokenizer: the tokenizer has no chat_template; pick a built-in template")
        if not getattr(tokenizer, "is_fast", False):  # a Python tokenizer cannot say where each token starts
            raise UserError(
                f"data.template=tokenizer: {type(tokenizer).__name__} is not a fast tokenizer, which the loss mask "
                "needs (the character offsets of its tokens); pick a built-in template"
            )
        return self._encode_rendered(conversations, tokenizer, default_system)

    def _encode_rendered(self, conversations, tokenizer, default_system) -> list[Encoded]:
        """Render, tokenize with character offsets, and label the reply spans found by `_spans`."""
        rendered = [self._spans(c, tokenizer, default_system) for c in conversations]
        batch = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        results = []
        for (_, spans), ids, offsets in zip(rendered, batch["input_ids"], batch["offset_mapping"], strict=True):
            starts = [start for start, _ in offsets]  # non-decreasing character offsets of the tokens
            labels = [IGNORE_INDEX] * len(ids)
            turn_ends = []
            for start, end, trained in spans:
                first, stop = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
                if trained:
                    labels[first:stop] = ids[first:stop]
                turn_ends.append(stop)
            results.append(Encoded(list(ids), labels, turn_ends))
        return results

    def render(self, conversation, tokenizer, default_system):
        messages = self._messages(conversation, default_system)
        open_turn = conversation.turns[-1].assistant is None
        return self._apply(tokenizer, messages, generation_prompt=open_turn)

    def prompt_ids(self, conversation, tokenizer, default_system):
        text = self.render(conversation, tokenizer, default_system)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def stop_strings(self, tokenizer):
        return [tokenizer.eos_token]


_DEEPSEEK_CODER_SYSTEM = (
    "You are an AI programming assistant, utilizing the DeepSeek Coder model, developed by "
    "DeepSeekCompany, and you only answer questions related to computer science. For politically "
    "sensitive questions, security and privacy issues, and other non-computer science questions, "
    "you will refuse to answer. {system}\n"
)
_CHATML_SYSTEM = "<|im_start|>system\n{system}<|im_end|>\n"
_CHATML_INSTRUCTION = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"
_INST = PromptTemplate(system="[INST] {system} [/INST]\n", instruction="[INST] {input} [/INST]", sep="\n")

BUILT_IN: dict[str, PromptTemplate] = {
    "deepseek_coder": PromptTemplate(
        system=_DEEPSEEK_CODER_SYSTEM, instruction="### Instruction:\n{input}\n### Response:\n", sep="\n"
    ),
    "deepseek_v2": PromptTemplate(
        system="{system}\n\n",
        instruction="User: {input}\n\nAssistant: ",
        suffix="<｜end▁of▁sentence｜>",
        suffix_as_eos=True,
        stop_words=("<｜end▁of▁sentence｜>",),
    ),
    "llama3_chat": PromptTemplate(
        system="<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>",
        instruction=(
            "<|start_header_id|>user<|end_header_id|>\n\n{input}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        suffix="<|eot_id|>",
        suffix_as_eos=True,
        stop_words=("<|eot_id|>",),
    ),
    "qwen_chat": PromptTemplate(
        system=_CHATML_SYSTEM,
        instruction=_CHATML_INSTRUCTION,
        suffix="<|im_end|>",
        suffix_as_eos=True,
        sep="\n",
        stop_words=("<|im_end|>", "<|endoftext|>"),
    ),
    "internlm2_chat": PromptTemplate(
        system=_CHATML_SYSTEM,
        instruction=_CHATML_INSTRUCTION,
        suffix="<|im_end|>",
        suffix_as_eos=True,
        sep="\n",
        stop_words=("<|im_end|>",),
    ),
    "mistral": _INST,
    "mixtral": _INST,
    "zephyr": PromptTemplate(
        system="<|system|>\n{system}\n", instruction="<|user|>\n{input}\n<|assistant|>\n", sep="\n"
    ),
}

TOKENIZER = "tokenizer"


def recorded_template(spec: str | dict, where: Path) -> ChatTemplate:
    """The template a checkpoint's `tuneforge.json` names: a name, or an inline template's settings."""
    if isinstance(spec, str):
        return get_template(spec)
    try:
        return get_template(TemplateConfig.model_validate(spec))
    except ValueError as exc:  # pydantic's ValidationError: the settings of another version, or edited
        reason = (str(exc).splitlines() or [""])[:3]
        raise UserError(
            f"{where}: the recorded template is not readable ({'; '.join(reason)}); pass --template"
        ) from None


DEFAULT_TEMPLATE = "deepseek_coder"
"""A text model's template when `data.template` is unset (xtuner's default)."""


def template_spec(spec: str | TemplateConfig | None) -> str | TemplateConfig:
    """`data.template` with its default filled in (for a text model)."""
    return DEFAULT_TEMPLATE if spec is None else spec


def get_template(spec: str | TemplateConfig | None) -> ChatTemplate:
    """A built-in template by name, `tokenizer` for the tokenizer's Jinja template, or a custom one; None, the
    default."""
    spec = template_spec(spec)
    if isinstance(spec, TemplateConfig):
        return PromptTemplate(**{**spec.model_dump(), "stop_words": tuple(spec.stop_words)})
    if spec == TOKENIZER:
        return TokenizerTemplate()
    if spec not in BUILT_IN:
        names = ", ".join([*sorted(BUILT_IN), TOKENIZER])
        raise UserError(f"data.template: unknown template {spec!r}; choose one of {names}, or give an inline template")
    return BUILT_IN[spec]
