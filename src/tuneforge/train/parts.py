"""The parts of one training run, built once by `run.setup` and handed to the loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tuneforge.config.schema import Config
from tuneforge.data.batching import BatchPlanner, MicroBatch
from tuneforge.data.image_tokens import ImageTokens
from tuneforge.data.templates import ChatTemplate
from tuneforge.distributed import Layout
from tuneforge.engines import Engine
from tuneforge.model.moe import MoEMap
from tuneforge.objective import Objective
from tuneforge.watchdog import StallWatchdog

StepGroups = Iterator[tuple[int, list[MicroBatch]]]
"""(epoch, the micro-batches of one optimizer step), step after step."""


@dataclass
class RunParts:
    cfg: Config
    work_dir: Path
    tokenizer: PreTrainedTokenizerBase
    template: ChatTemplate
    engine: Engine
    moe: MoEMap
    planner: BatchPlanner
    steps_from: Callable[[int], StepGroups]
    """The step groups from a step on (0: the start): the data position of a fresh or resumed run."""
    watchdog: StallWatchdog
    objective: Objective
    """What each step minimises (built once over the engine's model: `train.objectives.build_objective`)."""
    validation: list[MicroBatch] | None = None
    flops_per_token: float = 0.0
    """Model FLOPs a token needs (`model.flops.model_flops_per_token`, counted before the engine sharded them)."""
    run_id: str = ""
    """The run this work dir belongs to (`run.json`): its step checkpoints record it."""
    layout: Layout = field(default_factory=Layout)
    images: ImageTokens | None = None
    """A vision-language model's image tokens and processor (generation with images, the saved processor)."""
    """This rank's data-parallel group and sequence shard (`parallel.sequence_parallel`)."""
