"""The normalized conversation every data format is converted to, and the reasons a sample is dropped."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    """One user message and the assistant's reply. `system` is the system prompt given before this turn."""

    user: str
    assistant: str | None
    """None only for the open turn of a generation prompt."""
    train: bool = True
    """Whether the reply (and its end-of-turn token) carries labels."""
    system: str = ""


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    origin: str
    """Where the sample came from (`file:line`, `file#row`), for reports and errors."""

    def messages(self) -> list[dict[str, str]]:
        """OpenAI-style messages, for Jinja chat templates."""
        out: list[dict[str, str]] = []
        for turn in self.turns:
            if turn.system:
                out.append({"role": "system", "content": turn.system})
            out.append({"role": "user", "content": turn.user})
            if turn.assistant is not None:
                out.append({"role": "assistant", "content": turn.assistant})
        return out


def prompt_conversation(history: list[tuple[str, str]], user: str, system: str = "") -> Conversation:
    """A conversation whose last turn is open for generation; `history` holds earlier (user, reply) pairs."""
    turns = [Turn(u, a, system=system if i == 0 else "") for i, (u, a) in enumerate(history)]
    turns.append(Turn(user, None, system=system if not history else ""))
    return Conversation(tuple(turns), origin="<prompt>")


class SampleError(Exception):
    """A record that cannot be trained on. It is dropped and counted under `reason`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
