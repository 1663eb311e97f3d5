"""`tuneforge chat`: talk to a checkpoint, with replies streamed token by token."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from tuneforge.config.schema import TemplateConfig
from tuneforge.data.conversation import prompt_conversation
from tuneforge.data.templates import get_template
from tuneforge.errors import UserError
from tuneforge.generate import generate_replies
from tuneforge.train.checkpoint import read_chat_meta


def load_for_chat(checkpoint: Path):
    transformers.utils.logging.disable_progress_bar()
    if not (checkpoint / "config.json").exists():
        raise UserError(
            f"{checkpoint}: not a model checkpoint (no config.json); pass a checkpoints/step-N or "
            "checkpoints/final directory"
        )
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return model, tokenizer, read_chat_meta(checkpoint) or {}


def run_chat(
    checkpoint: Path, prompt: str | None, system: str | None, template_name: str | None, max_new_tokens: int
) -> None:
    model, tokenizer, meta = load_for_chat(checkpoint)
    spec = template_name or meta.get("template")
    if spec is None:
        raise UserError(f"{checkpoint}: no tuneforge.json naming the chat template; pass --template NAME")
    template = get_template(TemplateConfig.model_validate(spec) if isinstance(spec, dict) else spec)
    system = system if system is not None else meta.get("system")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def answer(history: list[tuple[str, str]], user: str) -> str:
        prompts = [prompt_conversation(history, user)]
        return generate_replies(model, tokenizer, template, prompts, system, max_new_tokens, streamer=streamer)[0]

    if prompt is not None:
        answer([], prompt)
        return
    print("Chatting with", checkpoint, "(empty line or Ctrl-D to quit, /reset to start over)")
    history: list[tuple[str, str]] = []
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return
        if not text.strip():
            return
        if text.strip() == "/reset":
            history = []
            continue
        history.append((text, answer(history, text)))
        sys.stdout.flush()
