"""`tuneforge chat`: talk to a checkpoint, with replies streamed token by token."""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import TextStreamer

from tuneforge.checkpoint_records import CHAT_META
from tuneforge.data.conversation import IMAGE_MARK, SampleError, prompt_conversation
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.images import open_image
from tuneforge.data.templates import TokenizerTemplate, get_template, recorded_template
from tuneforge.data.vision_templates import MarkedTemplate, ProcessorTemplate
from tuneforge.errors import UserError
from tuneforge.generate import generate_replies
from tuneforge.terminal import safe_text
from tuneforge.trained import is_reward_model, load_trained

PIXEL_LIMIT = 100_000_000
"""Chat's limit on an image's declared pixels (as `data.image_pixel_limit`'s default)."""


class SafeStreamer(TextStreamer):
    """Streams a reply as text: what a model writes (one fine-tuned on someone else's data may write escape
    sequences) is shown on the terminal, never acted on."""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        super().on_finalized_text(safe_text(text), stream_end)


def run_chat(
    checkpoint: Path,
    prompt: str | None,
    system: str | None,
    template_name: str | None,
    max_new_tokens: int,
    base: Path | None = None,
    trust_remote_code: bool = False,
    images: list[Path] | None = None,
) -> None:
    """A full checkpoint, or an adapter on its base model (loaded as in training, k-bit included). `images`: the
    first prompt's images (a vision-language model)."""
    if checkpoint.is_dir() and is_reward_model(checkpoint):
        raise UserError(
            f"{checkpoint}: a reward model (train.objective: reward) scores conversations and does not write "
            "answers; load it with AutoModelForSequenceClassification (tuneforge export --merge writes one)"
        )
    trained = load_trained(checkpoint, base, trust_remote_code=trust_remote_code)
    model, tokenizer, meta = trained.model, trained.tokenizer, trained.meta
    spec = template_name or meta.get("template")
    if spec is None:
        raise UserError(f"{checkpoint}: no tuneforge.json naming the chat template; pass --template NAME")
    template = get_template(template_name) if template_name else recorded_template(spec, checkpoint / CHAT_META)
    system = system if system is not None else meta.get("system")
    streamer = SafeStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    image_tokens, sources = None, tuple(str(Path(image).resolve()) for image in images or [])
    if trained.processor is not None:
        image_tokens = ImageTokens(trained.processor)
        tokenizer = trained.processor.tokenizer
        if isinstance(template, TokenizerTemplate):
            template = ProcessorTemplate(trained.processor)
        else:
            template = MarkedTemplate(template, image_tokens.placeholder)
        for source in sources:
            try:
                open_image(source, PIXEL_LIMIT)  # a bad image is said now, before the model answers
            except SampleError as exc:
                raise UserError(f"--image: {exc.reason}: {exc.detail}") from None
    elif sources:
        raise UserError(f"--image: {checkpoint} is a text model; it reads no images")

    def answer(history: list[tuple[str, str]], user: str, shown: tuple[str, ...] = ()) -> str:
        prompts = [prompt_conversation(history, user, images=shown)]
        return generate_replies(
            model, tokenizer, template, prompts, system, max_new_tokens, streamer=streamer, images=image_tokens
        )[0]

    if prompt is not None or sources:
        prompt = prompt if prompt is not None else "Describe the image."
        if not _is_text(prompt):
            raise UserError("--prompt: not UTF-8 text; give the prompt in UTF-8")
        if sources and IMAGE_MARK not in prompt:
            # The images before the question, as a chat's content parts [image, text] put them.
            prompt = IMAGE_MARK * len(sources) + prompt
        try:
            answer([], prompt, sources)
        except SampleError as exc:
            raise UserError(f"--image: {exc.detail or exc.reason}") from None
        return
    print("Chatting with", checkpoint, "(empty line or Ctrl-D to quit, /reset to start over)")
    history: list[tuple[str, str]] = []
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return
        except UnicodeDecodeError:  # a strict terminal encoding refuses the line itself
            text = None
        if text is None or not _is_text(text):
            print("(not UTF-8 text: nothing sent; type the line again)")
            continue
        if not text.strip():
            return
        if text.strip() == "/reset":
            history = []
            continue
        history.append((text, answer(history, text)))
        sys.stdout.flush()


def _is_text(text: str) -> bool:
    """False for a string carrying undecodable bytes (Python keeps them as lone surrogates from argv or stdin)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
