"""How often llama.cpp answers as transformers does from the same checkpoint, per GGUF weight type.

    make .venv/.llamacpp                      # llama-cpp-python, compiled once
    .venv/bin/python benchmarks/gguf_agreement.py CHECKPOINT [--outtypes f32,f16,q8_0] [--heldout FILE]

Exports CHECKPOINT with `tuneforge export --format gguf` at each weight type, then answers every held-out prompt
(default: the demo's 200 colours) greedily twice: with tuneforge's generation from the checkpoint (transformers),
and with llama.cpp's chat completion on the GGUF (its own chat template, rendered by llama-cpp-python). Prints
how many replies agree and each side's exact match against the held-out answers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TUNEFORGE = str(Path(sys.executable).parent / "tuneforge")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--outtypes", default="f32,f16,q8_0")
    parser.add_argument("--heldout", type=Path, default=REPO / "configs" / "data" / "hex_rgb_heldout.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    arguments = parser.parse_args()

    from llama_cpp import Llama

    from tuneforge.data.conversation import Conversation, Turn
    from tuneforge.data.templates import recorded_template
    from tuneforge.generate import generate_replies
    from tuneforge.trained import load_trained

    records = [json.loads(line) for line in arguments.heldout.read_text().splitlines() if line.strip()]
    prompts = [record["messages"][0]["content"] for record in records]
    answers = [record["messages"][1]["content"] for record in records]
    trained = load_trained(arguments.checkpoint)
    template = recorded_template(trained.meta["template"], arguments.checkpoint)
    conversations = [Conversation((Turn(prompt, None),), "heldout") for prompt in prompts]
    expected = generate_replies(
        trained.model, trained.tokenizer, template, conversations, None, arguments.max_new_tokens, batch_size=200
    )
    right = sum(reply == answer for reply, answer in zip(expected, answers, strict=True))
    print(f"transformers: exact match {right / len(records):.3f} on {len(records)} held-out prompts")
    workspace = Path(tempfile.mkdtemp(prefix="gguf_agreement_"))
    for outtype in arguments.outtypes.split(","):
        out = workspace / outtype
        command = [TUNEFORGE, "export", str(arguments.checkpoint), "--out", str(out), "--format", "gguf"]
        subprocess.run([*command, "--outtype", outtype], check=True, capture_output=True)
        llm = Llama(model_path=str(out / "model.gguf"), n_ctx=256, verbose=False)
        replies = []
        for prompt in prompts:
            answer = llm.create_chat_completion(
                [{"role": "user", "content": prompt}], temperature=0.0, max_tokens=arguments.max_new_tokens
            )
            replies.append(answer["choices"][0]["message"]["content"])
        same = sum(a == b for a, b in zip(replies, expected, strict=True))
        right = sum(reply == answer for reply, answer in zip(replies, answers, strict=True))
        size = (out / "model.gguf").stat().st_size / 2**20
        print(
            f"{outtype:>5} ({size:.1f} MiB): {same}/{len(prompts)} replies equal transformers'; "
            f"llama.cpp exact match {right / len(records):.3f}"
        )


if __name__ == "__main__":
    main()
