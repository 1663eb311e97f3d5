"""The typed configuration: one section per concern, every field documented.

Field docstrings are the documentation: pydantic turns them into descriptions and
``tuneforge config-docs`` prints them. Validation happens at load time, before any
model is built, so a typo costs seconds, not a cluster allocation.
"""

from __future__ import annotations

import difflib
import math
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from tuneforge.config.data_sections import DataConfig, TemplateConfig
from tuneforge.config.model_sections import LoraSettings, ModelConfig, QuantizationConfig, VisionSettings
from tuneforge.config.objectives import OBJECTIVES, ObjectiveSpec, objective_spec
from tuneforge.config.rl_sections import RewardSpec, RLConfig
from tuneforge.config.section import Section

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EvalConfig",
    "ExactMatchConfig",
    "LogConfig",
    "LoraSettings",
    "ModelConfig",
    "ParallelConfig",
    "PreferenceConfig",
    "QuantizationConfig",
    "RLConfig",
    "RewardSpec",
    "Section",
    "TemplateConfig",
    "TrainConfig",
    "VisionSettings",
    "WatchdogConfig",
]


class TrainConfig(Section):
    lr: float = Field(2e-4, gt=0)
    """Peak learning rate, reached at the end of warmup."""

    min_lr: float = Field(0.0, ge=0)
    """Learning rate at the end of the decay."""

    optimizer: Literal["adamw"] = "adamw"
    """Optimizer (AdamW, decoupled weight decay)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""

    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (not applied to biases and norm weights)."""

    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, by optimizer step, from `lr` to `min_lr`."""

    warmup_ratio: float = Field(0.03, ge=0, le=1)
    """Fraction of all optimizer steps spent in linear warmup."""

    warmup_steps: int | None = Field(None, ge=0)
    """Warmup length in optimizer steps; overrides `warmup_ratio` when set."""

    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Compute precision: `bf16` autocast (works on CPU too), `fp16` autocast with loss scaling (for GPUs
    without bf16, such as V100 and T4), or plain `fp32`. Weights the optimizer updates stay fp32. `auto`: bf16
    on GPUs that compute it and on CPUs with AVX512-BF16 or AMX, fp32 elsewhere (on a CPU without them bf16 is
    emulated, several times slower); the run's first lines say which and why."""

    loss_scale: float | None = Field(None, gt=0)
    """fp16 only: a fixed loss scale. None scales dynamically: a step whose gradients overflow is skipped,
    counted and the scale halved; after `loss_scale_window` clean steps it doubles."""

    initial_loss_scale: float = Field(2.0**16, gt=0)
    """fp16 dynamic scaling: the scale of the first step (a power of two)."""

    loss_scale_window: int = Field(1000, ge=1)
    """fp16 dynamic scaling: clean steps in a row before the scale doubles."""

    micro_batch_size: int = Field(1, ge=1)
    """Samples per forward pass on each process."""

    gradient_accumulation: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""

    epochs: int = Field(1, ge=1)
    """Passes over the training data (ignored when `max_steps` is set)."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (cycling over epochs as needed)."""

    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still reported)."""

    router_aux_loss_coef: float | None = Field(None, ge=0)
    """MoE models: weight of the router load-balancing loss added to the training loss (it equals top_k when
    routing is balanced). None takes the model config's `router_aux_loss_coef`, else 0.001; 0 turns it off."""

    objective: str = "sft"
    """What a step minimises: `sft` the cross-entropy of the answers; `dpo` and `orpo` a preference loss over
    pairs of a chosen and a rejected answer; `reward` trains a reward model (a scalar score per conversation)
    to rank each pair's chosen answer above the rejected one (`preference:`; the data then holds pairs). Each
    is described in `tuneforge.config.objectives`."""

    max_nonfinite_steps: int = Field(3, ge=1)
    """A step whose loss or gradient norm is not finite is skipped and reported with its samples; the run stops
    after this many in a row (under DeepSpeed, which cannot skip a bf16/fp32 step, at the first)."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them: about a third more
    compute for much less activation memory. Turn it on when activations are what does not fit."""

    compile: bool = False
    """Compile each decoder layer's norms and gated MLP with `torch.compile` (fused element-wise work; attention
    and experts stay eager). Costs a compile at start (about half a minute on CPU), needs a C++ compiler on
    CPU or triton on GPUs, and works with parallel.engine single or ddp."""

    seed: int = Field(42, ge=0)
    """Seed for model init, shuffling and dropout: the same seed gives the same run on CPU."""

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, name: str) -> str:
        if name not in OBJECTIVES:
            close = difflib.get_close_matches(name, list(OBJECTIVES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown objective {name!r}{hint}; one of {', '.join(OBJECTIVES)}")
        return name

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"`train.betas` must each be in [0, 1), got {list(self.betas)}")
        if self.min_lr > self.lr:
            raise ValueError(f"`train.min_lr` ({self.min_lr}) must not exceed `train.lr` ({self.lr})")
        power = math.log2(self.initial_loss_scale)
        if power != int(power):
            raise ValueError(f"`train.initial_loss_scale` must be a power of two, got {self.initial_loss_scale}")
        return self


class PreferenceConfig(Section):
    """Preference objectives (`train.objective: dpo`, `orpo` or `reward`): trained on pairs of a chosen and a
    rejected answer to the same prompt."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, populate_by_name=True
    )

    beta: float = Field(0.1, gt=0)
    """DPO: how far the policy may move from the reference (the inverse temperature of the implicit reward)."""

    loss_type: Literal["sigmoid", "robust", "hinge", "ipo", "sppo_hard", "nca_pair"] = "sigmoid"
    """DPO's loss over the reward margin: `sigmoid` (the DPO paper), `robust` (noisy labels), `hinge` (SLiC),
    `ipo` (on mean token log-probabilities), `sppo_hard`, `nca_pair`."""

    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Probability that a pair's labels are flipped (conservative DPO, for `sigmoid` and `robust`)."""

    sft_weight: float = Field(0.0, ge=0)
    """Adds this times the chosen answer's mean token cross-entropy to each pair's DPO loss (RPO, xtuner's
    `loss_weight` on the SFT term); 0 turns it off."""

    orpo_lambda: float = Field(0.1, gt=0, alias="lambda")
    """ORPO: weight of the odds-ratio term beside the chosen answer's cross-entropy (written `lambda`)."""

    reward_loss: Literal["ranking", "focal"] = "ranking"
    """Reward models: `ranking` is -log sigmoid(score of chosen - score of rejected) (Bradley-Terry); `focal`
    weighs each pair by (1 - 2 max(0, p - 1/2))^2 with p that sigmoid, so pairs already ranked well count less
    (InternLM2's focal ranking loss)."""

    penalty: Literal["log_barrier", "l2", "none"] = "log_barrier"
    """Reward models: keeps scores in a stable range: `log_barrier` is -log(5 - s) - log(s + 5) on every score s
    (clamped 0.001 inside the bounds), `l2` is s^2; each times `penalty_weight`, per pair."""

    penalty_weight: float = Field(0.01, ge=0)
    """Reward models: the weight of `penalty` in the loss."""

    reference: Literal["auto", "adapters", "precompute", "model"] = "auto"
    """DPO's reference model: `adapters` is the base with the LoRA adapters disabled (no copy; LoRA and QLoRA);
    `precompute` is every answer's log-probability under the model before training, computed in one pass and
    kept in the work dir (`reference/`, read again on resume); `model` is a frozen copy of the model before
    training (the base, with LoRA), loaded a second time and held like the policy: a replica per rank, or sharded
    by FSDP2 or ZeRO-3 (offloaded with it); one more forward per micro-batch, no pass before training. `auto`
    takes `adapters` with LoRA, else `precompute`."""


class ParallelConfig(Section):
    engine: Literal["auto", "single", "ddp", "fsdp", "deepspeed"] = "auto"
    """Training engine: `single` (one process), `ddp` (a replica per rank, gradients all-reduced), `fsdp`
    (FSDP2: parameters, gradients and optimizer state sharded, one unit per decoder layer), `deepspeed`
    (ZeRO stage `zero_stage`). `auto` picks `single` for one process and `ddp` for several."""

    zero_stage: int = Field(3, ge=0, le=3)
    """DeepSpeed ZeRO stage: 0 (DDP-like), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)."""

    cpu_offload: Literal["none", "optimizer", "all"] = "none"
    """Keep state in CPU memory: `optimizer` (DeepSpeed ZeRO 1-3), `all` = optimizer and parameters
    (DeepSpeed ZeRO-3, or FSDP2, which offloads parameters, gradients and optimizer state together)."""

    moe_safety: bool = True
    """Make MoE blocks safe under sharding when ranks route tokens to different experts: ZeRO-3 gathers each
    block as one leaf module; FSDP2 reduce-scatters zero gradients for experts that got no tokens. Turning it
    off reproduces the deadlock of the original report; only for diagnosis."""

    deepspeed_config: str | None = None
    """A DeepSpeed JSON file merged over the generated one (its keys win), for settings we do not expose."""

    sequence_parallel: int = Field(1, ge=1)
    """Split each sample's tokens across a group of this many ranks (Ulysses: attention exchanges heads for
    tokens with an all-to-all, everything else runs on the rank's share), for samples whose activations do not
    fit one device. The data-parallel size is then world size / N: `train.micro_batch_size` is per group of N
    ranks. Needs attention and key/value heads divisible by N, and `model.attn_implementation: sdpa`."""

    expert_parallel: int = Field(1, ge=1)
    """Shard each MoE layer's routed experts over groups of N ranks and exchange tokens with an all-to-all
    instead of gathering every expert on every rank (DeepSpeed's AutoEP; `engine: deepspeed`, ZeRO 0-2, full
    fine-tuning of DeepSeek-V2/V3 models). N divides the world size and the expert count. Checkpoints keep the
    Hugging Face layout: the experts are gathered when they are written."""

    # What each engine cannot do with these settings is the engine's to say: `Engine.setting_problems`, checked
    # when the run chooses its engine.


class CheckpointConfig(Section):
    every_steps: int = Field(500, ge=0)
    """Save every N optimizer steps under `checkpoints/step-N/` (0: only the final one)."""

    keep_last: int | None = Field(2, ge=1)
    """Keep only the newest K `step-N` checkpoints (None keeps all); `final` is always kept."""

    save_final: bool = True
    """Save `checkpoints/final/` when training ends."""

    keep_best: bool = False
    """Also keep `checkpoints/best/`: the model at the lowest validation loss so far (needs a validation split)."""


class ExactMatchConfig(Section):
    file: str
    """JSONL file in the `messages` format; the last assistant message is the reference answer."""

    label: str = "eval"
    """Name printed as `<label> accuracy: X` and stored in `eval.json`."""

    max_new_tokens: int = Field(32, ge=1)
    """Generation budget per answer."""

    batch_size: int = Field(64, ge=1)
    """Prompts generated together."""


class LmEvalConfig(Section):
    tasks: list[str] = Field(min_length=1)
    """lm-evaluation-harness task names and local task YAML files (absolute, relative to the config file like its
    data, or else to the directory tuneforge runs in), scored on the final checkpoint as `tuneforge eval WORK_DIR
    --tasks ...` does (needs `pip install 'tuneforge[eval]'`)."""

    limit: int | None = Field(None, ge=1)
    """Score the first N examples of each task (None: all)."""

    batch_size: int = Field(16, ge=1)
    """The harness's batch size."""

    base: bool = True
    """Also score the model training started from, beside the trained one."""

    at_checkpoints: bool = False
    """Also score each step checkpoint when it is saved (`checkpoint.every_steps`), the model alone, into
    `eval/lm_eval-step-N.json`: training waits while the harness runs on the first rank's device, when the
    device has room for the model beside training's memory (else that checkpoint is skipped, said)."""

    timeout_s: float = Field(7200.0, gt=0)
    """A checkpoint's scoring that runs longer is ended (said) and training goes on."""


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Validation loss every N optimizer steps, on all ranks, when there is a validation split (0: only at the
    end). Logged as `val_loss` in `metrics.jsonl`."""

    sample_prompts: list[str] = Field(default_factory=list)
    """User prompts answered (greedy) during training, printed and written to `samples.jsonl`."""

    sample_every_steps: int = Field(0, ge=0)
    """Answer `sample_prompts` every N optimizer steps (0: only at the end)."""

    sample_at_start: bool = False
    """Also answer them before the first step."""

    sample_max_new_tokens: int = Field(64, ge=1)
    """Generation budget for each sample answer."""

    sample_system: str | None = None
    """The system prompt of the sample chats; None: `data.system`, the one training uses. A chat hook's own
    prompt (xtuner's `EvaluateChatHook.system`) goes here, so it never changes the text trained on."""

    exact_match: ExactMatchConfig | None = None
    """After training, greedy answers are compared to references; the accuracy goes to `eval.json`."""

    lm_eval: LmEvalConfig | None = None
    """After training, the final checkpoint is scored with lm-evaluation-harness tasks in the training chat
    template, beside its base; the results go to `eval/lm_eval.json`."""


class LogConfig(Section):
    every_steps: int = Field(1, ge=1)
    """Print a progress line every N optimizer steps when the console is not a terminal."""

    progress: Literal["auto", "bar", "lines"] = "auto"
    """`bar` redraws a live progress bar, `lines` prints lines, `auto` picks by terminal."""

    tensorboard: bool = False
    """Also write every step's metrics as TensorBoard scalars under `<work_dir>/tensorboard/` (needs
    `pip install 'tuneforge[tensorboard]'`)."""

    wandb: bool = False
    """Also log every step's metrics and the resolved config to Weights & Biases (needs
    `pip install 'tuneforge[wandb]'`); runs are kept under `<work_dir>/wandb/`."""

    wandb_project: str = Field("tuneforge", min_length=1)
    """W&B project the run belongs to."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline` needs no network or account (upload later with `wandb sync <work_dir>/wandb/offline-run-*`);
    `online` streams to the W&B server and needs a login."""

    plot: bool = True
    """Draw loss and learning rate against the step into `<work_dir>/plot.png` at the end of training."""


class WatchdogConfig(Section):
    enabled: bool = True
    """Dump every thread's stack to `diagnostics/` and exit non-zero when training stalls."""

    startup_timeout_s: float = Field(1800.0, gt=0)
    """Allowed time for model set-up and the first micro-step, and for saving a checkpoint."""

    stall_timeout_s: float | None = Field(None, gt=0)
    """Allowed time without progress after the first micro-step. None: `stall_step_multiple` times the median
    step time, at least `stall_floor_s`."""

    stall_floor_s: float = Field(300.0, gt=0)
    """Smallest automatic stall limit."""

    stall_step_multiple: float = Field(10.0, gt=1)
    """Automatic stall limit as a multiple of the median optimizer step time."""

    generation_timeout_s: float | None = Field(None, gt=0)
    """Allowed time without progress while generating (sample chats; each generated batch is progress). None:
    the stall limit, as for a step. Raise it where one batch of replies takes longer than ten steps."""

    report_grace_s: float = Field(10.0, gt=0)
    """After a stall, how long each rank waits for the others' dumps before the report is written."""

    stop_grace_s: float = Field(25.0, gt=0)
    """On SIGTERM or SIGINT: the time to finish the step and save a checkpoint before exiting. Keep it under the
    scheduler's kill delay (30 s by default for SLURM, Kubernetes and torchrun); past it, or when a step
    checkpoint took longer than what is left, the run stops without one and resumes from the previous."""

    doctor: Literal["fail", "warn", "off"] = "fail"
    """The pre-flight checks of `tuneforge doctor` at train start: `fail` stops on a failed check, `warn` only
    reports (for reproducing a known-bad set-up on purpose), `off` skips them."""


class Config(Section):
    model: ModelConfig
    """What to fine-tune."""
    data: DataConfig
    """What to train on."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimization."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """How the work is split across processes."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """What is saved and when."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Samples and accuracy checks."""
    log: LogConfig = Field(default_factory=LogConfig)
    """Console progress, metric sinks (TensorBoard, W&B) and the plot."""
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    """Stall detection."""
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    """Preference training (`train.objective: dpo`, `orpo` or `reward`)."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """Online reinforcement learning (`train.objective: grpo`)."""

    @model_validator(mode="after")
    def _check_objective(self) -> Config:
        problems = self.objective.problems(self)
        if problems:
            raise ValueError(problems[0])
        return self

    @model_validator(mode="after")
    def _checkpoints_to_score(self) -> Config:
        scoring = self.eval.lm_eval
        if scoring is not None and scoring.at_checkpoints and not self.checkpoint.every_steps:
            raise ValueError(
                "eval.lm_eval.at_checkpoints scores step checkpoints, and checkpoint.every_steps is 0: set it, or "
                "leave at_checkpoints off (the final checkpoint is scored either way)"
            )
        return self

    @property
    def objective(self) -> ObjectiveSpec:
        """What `train.objective` is: its data, unit, head, reference and checks."""
        return objective_spec(self.train.objective)

    @property
    def reference(self) -> str | None:
        """The objective's reference, resolved (`auto`: the disabled adapters with LoRA, else precomputed); None
        for an objective without one."""
        return self.objective.reference(self)

    @property
    def paired(self) -> bool:
        """The data holds preference pairs (a chosen and a rejected answer per row), not conversations."""
        return self.objective.paired
