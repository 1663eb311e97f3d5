"""A reward model as one of online RL's rewards (`rl.rewards: [{kind: model, path: ...}]`).

The model is one `train.objective: reward` wrote (a checkpoint with a score head, or its adapter on a base) or
any `AutoModelForSequenceClassification` directory with one label. Each completion is scored as the reward model
was trained: the prompt's conversation with the completion as the assistant's reply, rendered with the reward
model's own template and tokenizer (recorded in its `tuneforge.json`), the score read at the last token that is
not the pad token. Loading reads weights only (safetensors, or pickles refused unless weights-only): a config
naming a reward model runs no code.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tuneforge.checkpoint_records import CHAT_META
from tuneforge.config.schema import RewardSpec
from tuneforge.data.conversation import Conversation
from tuneforge.data.templates import ChatTemplate, get_template, recorded_template
from tuneforge.errors import UserError
from tuneforge.model.precision import AUTOCAST_DTYPES, autocast
from tuneforge.trained import is_reward_model, load_trained


class RewardModelScorer:
    """Scores (prompt, completion) pairs with a reward model, `batch_size` conversations a forward. Loaded by
    `load` onto the policy's device (on CPU in float32 at its first use otherwise)."""

    needs_prompts = True

    def __init__(self, path: str, batch_size: int, where: str):
        self.path = Path(path)
        self.batch_size = batch_size
        self.where = where
        if not self.path.is_dir():
            raise UserError(f"{where}: {path} is not a directory; point `path` at a reward model's checkpoint")
        if not is_reward_model(self.path):
            raise UserError(
                f"{where}: {path} is not a reward model (no single-score head); train one with "
                "train.objective: reward, or give a sequence-classification model with one label"
            )
        self.model = None
        self.tokenizer = None
        self.template: ChatTemplate | None = None
        self.system: str | None = None
        self.device = torch.device("cpu")
        self.precision = "fp32"

    def load(self, device: torch.device, precision: str) -> None:
        """Read the model (merged, for a plain forward) onto `device`; its template and system prompt from its
        record."""
        trained = load_trained(self.path, merge=True)
        meta = trained.meta
        if meta.get("template") is not None:
            self.template = recorded_template(meta["template"], self.path / CHAT_META)
        elif getattr(trained.tokenizer, "chat_template", None):
            self.template = get_template("tokenizer")
        else:
            raise UserError(
                f"{self.where}: {self.path} records no chat template (no tuneforge.json) and its tokenizer has none; "
                "the reward model's conversations cannot be rendered as it was trained"
            )
        self.system = meta.get("system")
        self.tokenizer = trained.tokenizer
        # Scored in the run's compute dtype: a 7B reward model takes 14 GB beside the policy, not 28.
        dtype = AUTOCAST_DTYPES.get(precision, torch.float32)
        self.model = trained.model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.device, self.precision = device, precision
        if getattr(self.model.config, "num_labels", 1) != 1:
            labels = self.model.config.num_labels
            raise UserError(f"{self.where}: {self.path} has {labels} labels; a reward is one score")
        if self.tokenizer.pad_token_id is None or self.model.config.pad_token_id is None:
            raise UserError(f"{self.where}: {self.path} has no pad token, where its score is read; set one")

    @torch.no_grad()
    def __call__(self, completions: list[str], answers: list[str], prompts: list[Conversation]) -> list[float]:
        if self.model is None:
            self.load(torch.device("cpu"), "fp32")
        assert self.template is not None and self.tokenizer is not None
        conversations = [
            replace(prompt, turns=(*prompt.turns[:-1], replace(prompt.turns[-1], assistant=completion)))
            for prompt, completion in zip(prompts, completions, strict=True)
        ]
        scores: list[float] = []
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(conversations), self.batch_size):
            batch = conversations[start : start + self.batch_size]
            encoded = [e.input_ids for e in self.template.encode(batch, self.tokenizer, self.system)]
            width = max(len(ids) for ids in encoded)
            input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(encoded):  # right-padded: the head reads the last token that is not the pad
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
            with autocast(self.precision, self.device):
                logits = self.model(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
                ).logits
            scores += logits[:, 0].float().tolist()
        return scores


def reward_model_scorer(spec: RewardSpec, where: str) -> RewardModelScorer:
    """`build_rewards`' maker of `kind: model` rewards."""
    assert spec.path is not None
    return RewardModelScorer(spec.path, spec.batch_size, where)
