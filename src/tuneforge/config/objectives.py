"""What each training objective (`train.objective`) is, in one place: the data it reads, the unit its mean is
over, whether the model gets a scalar head, its reference modes, the forwards it adds to the policy's, and the
config checks it owns. The run, the estimate, the doctor, the CLI and the config validation ask the spec;
nothing else compares objective names. (The objects that compute each loss are built from the spec's name in
`train.objectives`.)

It lives beside the config, not in `objective/`, because the config's validation reads it and the config is
the bottom layer every other package builds on; it imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Config = Any
"""A `tuneforge.config.schema.Config` (which imports this module: named here without importing it back)."""

Check = Callable[[Config], "str | None"]
"""A config check an objective owns: the problem and its fix in one line, or None."""


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    """The value of `train.objective`."""
    data: Literal["chats", "pairs", "prompts"]
    """What a sample is: a conversation, a pair of a chosen and a rejected answer under one prompt, or a prompt
    with the answer its completions are rewarded against."""
    unit: str
    """What the step's mean is over, in messages ("target tokens", "pairs")."""
    description: str
    scalar_head: bool = False
    """The model ends in one score per position instead of the vocabulary (a reward model)."""
    writes_answers: bool = True
    """The trained model answers prompts (sample chats and exact match apply)."""
    references: tuple[str, ...] = ()
    """`preference.reference` modes it can use, `auto` resolved by `reference`; () has no reference."""
    checks: tuple[Check, ...] = ()

    @property
    def paired(self) -> bool:
        return self.data == "pairs"

    def reference(self, cfg: Config) -> str | None:
        """The reference mode the run uses: `auto` is the base with its adapters disabled under LoRA, else the
        log-probabilities precomputed before training; None for an objective without a reference."""
        if not self.references:
            return None
        asked = cfg.preference.reference
        if asked == "auto":
            return "adapters" if cfg.model.lora is not None else "precompute"
        return asked

    def extra_forwards(self, cfg: Config) -> int:
        """Forwards per micro-batch beyond the policy's, with no backward: the reference's, where it is a model
        (the base with its adapters disabled, or a frozen copy) rather than a table computed before training."""
        return 1 if self.reference(cfg) in ("adapters", "model") else 0

    def reference_pass(self, cfg: Config) -> bool:
        """A forward pass over the whole data before the first step (the precomputed reference's)."""
        return self.reference(cfg) == "precompute"

    def frozen_copy(self, cfg: Config) -> bool:
        """A second copy of the model, frozen, held beside the policy."""
        return self.reference(cfg) == "model"

    @property
    def prompted(self) -> bool:
        """The model writes its own training data from prompts (online reinforcement learning)."""
        return self.data == "prompts"

    @property
    def sample_word(self) -> str:
        """What one training sample is called in messages."""
        return "pairs" if self.paired else "prompts" if self.prompted else "samples"

    def batch_unit(self, packing: bool) -> str:
        """What `train.micro_batch_size` counts."""
        return "rows" if packing else self.sample_word

    def problems(self, cfg: Config) -> list[str]:
        """The config's problems with this objective (the checks every objective gets from its facts, then its
        own)."""
        found = []
        if not self.references and cfg.preference.reference != "auto":
            found.append(
                f"preference.reference: {cfg.preference.reference} does nothing with train.objective: {self.name}, "
                f"which has no reference model (only {', '.join(with_reference())} has one); remove "
                "preference.reference, or set train.objective: dpo"
            )
        if not self.writes_answers and (cfg.eval.sample_prompts or cfg.eval.exact_match is not None):
            found.append(
                f"train.objective: {self.name} trains a scoring model, which does not write answers: remove "
                "eval.sample_prompts and eval.exact_match (validation reports the ranking accuracy of held-out pairs)"
            )
        found.extend(problem for check in self.checks if (problem := check(cfg)) is not None)
        return found


def _adapters_need_lora(cfg: Config) -> str | None:
    if cfg.model.lora is None and cfg.preference.reference == "adapters":
        return (
            "preference.reference: adapters needs model.lora (the reference is the base with the adapters "
            "disabled); for full fine-tuning use preference.reference: precompute (or auto)"
        )
    return None


def _no_frozen_copy_under_expert_parallelism(cfg: Config) -> str | None:
    if cfg.preference.reference == "model" and cfg.parallel.expert_parallel > 1:
        return (
            "preference.reference: model is not built under parallel.expert_parallel (a second AutoEP model); "
            "use preference.reference: precompute (expert parallelism trains every weight, so adapters, "
            "and a reference made by disabling them, are not available there)"
        )
    return None


OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register(spec: ObjectiveSpec) -> ObjectiveSpec:
    OBJECTIVES[spec.name] = spec
    return spec


register(
    ObjectiveSpec(
        "sft",
        data="chats",
        unit="target tokens",
        description="the cross-entropy of the answers",
    )
)
register(
    ObjectiveSpec(
        "dpo",
        data="pairs",
        unit="pairs",
        description="direct preference optimisation over pairs, against a reference model",
        references=("adapters", "precompute", "model"),
        checks=(_adapters_need_lora, _no_frozen_copy_under_expert_parallelism),
    )
)
register(
    ObjectiveSpec(
        "orpo",
        data="pairs",
        unit="pairs",
        description="odds-ratio preference optimisation: the chosen answer's cross-entropy plus an odds-ratio term",
    )
)
register(
    ObjectiveSpec(
        "reward",
        data="pairs",
        unit="pairs",
        description="a reward model: one score per conversation, ranking each pair's chosen answer first",
        scalar_head=True,
        writes_answers=False,
    )
)


def _kl_needs_adapters(cfg: Config) -> str | None:
    if cfg.rl.kl_coef and cfg.model.lora is None:
        return (
            "rl.kl_coef: the KL reference is the base with its adapters disabled, which needs model.lora; set "
            "rl.kl_coef: 0 (the default) for full fine-tuning"
        )
    return None


def _prompts_unpacked(cfg: Config) -> str | None:
    if cfg.data.packing:
        return "data.packing: grpo batches prompts and packs nothing (its completions are its own); remove it"
    return None


def _prompts_without_validation_loss(cfg: Config) -> str | None:
    if cfg.data.validation_files or cfg.data.validation_fraction:
        return (
            "data.validation_files / validation_fraction: grpo has no validation loss (prompts carry no targets); "
            "measure held-out accuracy with eval.exact_match instead"
        )
    return None


register(
    ObjectiveSpec(
        "grpo",
        data="prompts",
        unit="completions",
        description="group-relative policy optimisation: completions sampled per prompt, rewarded, and weighted "
        "against their group's",
        checks=(_kl_needs_adapters, _prompts_unpacked, _prompts_without_validation_loss),
    )
)


def with_reference() -> list[str]:
    return [name for name, spec in OBJECTIVES.items() if spec.references]


def objective_spec(name: str) -> ObjectiveSpec:
    return OBJECTIVES[name]
