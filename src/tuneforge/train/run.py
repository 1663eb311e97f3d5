"""`tuneforge train` in one process (of possibly many): config -> data -> model -> engine -> loop -> evaluation."""

from __future__ import annotations

import os
import random
import shlex
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from tuneforge.config import Config, dump_config
from tuneforge.data.batching import MicroBatch
from tuneforge.data.loader import make_planner, padding_by_strategy
from tuneforge.data.pipeline import PreparedData, prepare_data
from tuneforge.data.prompts import prompt_lookup, room_for
from tuneforge.data.report import format_report, nothing_trains
from tuneforge.data.templates import get_template
from tuneforge.diagnostics.recorder import RECORDER
from tuneforge.diagnostics.stacks import exception_site
from tuneforge.distributed import DistInfo, Layout, barrier, gather_objects, init_distributed
from tuneforge.doctor import FAIL, format_checks, run_checks
from tuneforge.engines import Engine, EngineChoice, EngineTraits, choose_engine
from tuneforge.engines.base import FrozenModel
from tuneforge.errors import SharedUserError, UserError
from tuneforge.forked_rng import forked_rng
from tuneforge.host_memory import freed_host_memory_kept
from tuneforge.model import packed_attention
from tuneforge.model.build import (
    DTYPES,
    build_frozen_copy,
    build_model,
    build_tokenizer,
    count_parameters,
    model_config,
)
from tuneforge.model.compile import check_compiler, compile_elementwise
from tuneforge.model.flops import forward_flops_per_token, model_flops_per_token
from tuneforge.model.moe import MoEMap, find_moe
from tuneforge.model.precision import with_precision
from tuneforge.model.router_balance import RouterBalance, attach_router_balance
from tuneforge.model.sequence_parallel import init_groups, unsupported
from tuneforge.model.trainable import make_trainable
from tuneforge.model.vision_training import part_learning_rates, settings_of
from tuneforge.objective.rewards import ALLOW_REWARD_CODE, build_rewards, load_reward_models
from tuneforge.rollout_samplers import generator_problem, shut_down_engines
from tuneforge.run_files import RunFiles
from tuneforge.train.checkpoint import tidy_checkpoints
from tuneforge.train.evaluate import exact_match, write_result
from tuneforge.train.faults import FaultInjector, injected_fault
from tuneforge.train.inputs import check_inputs, checkpoint_bytes, disk_room_problems
from tuneforge.train.loop import Trainer, step_groups, steps_per_epoch
from tuneforge.train.objectives import PromptContext, build_objective
from tuneforge.train.optim import build_optimizer
from tuneforge.train.parts import RunParts, StepGroups
from tuneforge.train.plot import plot_at_end
from tuneforge.train.reference import reference_pass
from tuneforge.train.resume import checked_resume, resume_from, run_precision
from tuneforge.train.reward_model import reward_model_scorer
from tuneforge.train.sinks import require_packages
from tuneforge.train.state import data_changed_note
from tuneforge.train.validate import validation_batches
from tuneforge.train.vision import VisionRun, check_packing, vision_run
from tuneforge.train.workdir import recorded_run, release_lock, start_run, take_lock
from tuneforge.watchdog import StallWatchdog

Say = Callable[[str], None]
"""Prints on rank 0, does nothing on the others."""


def quiet_known_noise() -> None:
    """DeepSpeed calls collectives that torch 2.13 renamed; the deprecation notices repeat every step and say
    nothing actionable to a user."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def run_training(cfg: Config, work_dir: Path, resume: str | None = None, archive_previous: bool = False) -> dict:
    """Train as configured; returns a summary (final loss, steps, accuracy if configured). `resume`: `auto`
    (the newest complete step checkpoint of this work dir's run, if any) or a checkpoint path.
    `archive_previous`: a fresh run into a work dir with another run's outputs moves them aside first."""
    require_packages(cfg.log)  # a missing TensorBoard or W&B package is reported now, not after the model loads
    if cfg.eval.lm_eval is not None:  # the harness and the local task files, said now too
        from tuneforge.lm_eval_tasks import check_settings

        cfg.eval.lm_eval.tasks = check_settings(cfg.eval.lm_eval)
    check_inputs(cfg, work_dir)  # every file and path the config names, before anything is loaded or written
    quiet_known_noise()
    info = init_distributed()
    transformers.utils.logging.disable_progress_bar()  # our own progress is the one to read
    say: Say = print if info.is_main else (lambda _: None)
    engine_name = choose_engine(cfg.parallel.engine, info, cfg.parallel)
    lock_note = take_lock(work_dir) if info.is_main else ""
    try:
        summary = _locked_run(cfg, work_dir, resume, archive_previous, info, engine_name, say, lock_note)
        if cfg.eval.lm_eval is not None and info.is_main:  # in a process of its own, the work dir still held
            from tuneforge.lm_eval_tasks import score_after_training

            score_after_training(cfg.eval.lm_eval, work_dir, str(info.device), cfg.model.trust_remote_code)
        return summary
    finally:
        if info.is_main:
            release_lock(work_dir)


def _locked_run(
    cfg: Config,
    work_dir: Path,
    resume: str | None,
    archive_previous: bool,
    info: DistInfo,
    engine_name: str,
    say: Say,
    lock_note: str,
) -> dict:
    # Leftovers of a run killed while saving, cleared by the rank holding the work dir's lock before any rank
    # looks for its resume point.
    for line in tidy_checkpoints(RunFiles(work_dir).checkpoints) if info.is_main else []:
        say(line)
    barrier(info)
    # Everything that can refuse the run is checked before this run writes a file.
    resume_dir = checked_resume(cfg, work_dir, resume, info, engine_name, say)
    requested = cfg.train.precision
    precision, why = run_precision(requested, info, resume_dir)
    cfg = with_precision(cfg, precision)  # every part reads the precision chosen, and config.yaml records it
    engine = EngineChoice.of(engine_name, cfg.parallel, cfg.train, info.device.type)  # traits at this precision
    run_id = record_run(cfg, work_dir, resume, archive_previous, info, say, lock_note)
    say(f"work dir: {work_dir}  (resolved config: {RunFiles(work_dir).config})")
    chosen = " (parallel.engine=auto)" if cfg.parallel.engine == "auto" else ""
    say(
        f"engine: {engine_name}{chosen}, {info.world_size} process(es), device {info.device.type}, "
        f"{torch.get_num_threads()} CPU threads each"
    )
    if why:
        say(f"precision: {precision} (train.precision={requested}: {why})")
    if info.distributed:
        RECORDER.install()  # before any engine exists: DeepSpeed keeps references to the functions it uses
    watchdog = StallWatchdog.for_config(cfg.watchdog, RunFiles(work_dir).diagnostics, info.rank, info.world_size)
    watchdog.start()
    outcome = "failed"
    try:
        parts = setup(cfg, work_dir, watchdog, info, engine, say, run_id)
        result = train_and_evaluate(parts, info, say, resume, resume_dir)
        outcome = "finished"
        return result
    except (torch.distributed.DistError, RuntimeError) as exc:
        if info.distributed and cfg.watchdog.enabled:
            # A collective that failed (gloo/NCCL errors on mismatched calls) or a rank that failed on its own (out
            # of memory) leaves the others waiting: the same diagnosis as a hang.
            message = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
            watchdog.fail("error", message, exit_process=False, where=exception_site(exc))
        raise
    finally:
        # vLLM's teardown ends the process group it shares: first, and watched like the rest of the run.
        if problem := shut_down_engines():
            print(f"rank {info.rank}: {problem}", file=sys.stderr, flush=True)
        watchdog.stop(outcome)
        if info.distributed and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def record_run(
    cfg: Config, work_dir: Path, resume: str | None, archive_previous: bool, info: DistInfo, say: Say, lock_note: str
) -> str:
    """This run's record and resolved config in the work dir (rank 0), and its id on every rank."""
    # Every rank has read the run record (for find_resume) before rank 0 writes this run's: a rank reading it
    # half-written failed to parse it, and one reading the new id could choose another checkpoint than rank 0.
    barrier(info)
    run_id = ""
    if info.is_main:
        run_id, run_note = start_run(work_dir, resume, archive_previous)
        for note in (lock_note, run_note):
            if note:
                say(note)
        dump_config(cfg, RunFiles(work_dir).config)
        # Dumps of an earlier run in this work dir would confuse this run's diagnosis.
        shutil.rmtree(RunFiles(work_dir).diagnostics, ignore_errors=True)
    barrier(info)
    return run_id or recorded_run(work_dir) or ""


def setup(
    cfg: Config,
    work_dir: Path,
    watchdog: StallWatchdog,
    info: DistInfo,
    chosen: EngineChoice,
    say: Say,
    run_id: str,
) -> RunParts:
    """Everything the loop needs, as named steps in the order that lets each fail early (bad data before the
    doctor, the doctor before the model loads). The run is seeded once: building models draws from a fork of the
    generator, so the training stream does not depend on what they drew."""
    seed_everything(cfg.train.seed)
    template = get_template(cfg.data.template)
    tokenizer = build_tokenizer(cfg.model)
    vision = vision_run(cfg, tokenizer, say)
    if vision is not None:
        tokenizer, template = vision.tokenizer, vision.template
    # Rewards first: one that may not run (python code without --allow-reward-code) is said before anything loads.
    rewards = []
    if cfg.objective.prompted:
        rewards = build_rewards(cfg.rl.rewards, os.environ.get(ALLOW_REWARD_CODE) == "1", reward_model_scorer)
    watchdog.beat("data", training=False)
    data = load_data(cfg, tokenizer, template, info, say, vision)
    if cfg.watchdog.doctor != "off":
        preflight(cfg, chosen, info, tokenizer, data.training_units(cfg.paired), say)
    layout = sequence_layout(cfg, info, tokenizer, say)
    check_engine(cfg, chosen, info, tokenizer, say)
    traits = chosen.traits
    watchdog.beat("model", training=False)
    with forked_rng(info.device):
        model, moe, balance, flops_per_token = trainable_model(cfg, tokenizer, info, work_dir, traits, say)
    if vision is not None:
        check_packing(cfg, model)
    engine = chosen.build(model, optimizer_for(cfg), info, cfg.parallel, cfg.train, moe, balance)
    reference_model = frozen_reference(cfg, engine, tokenizer, info, work_dir, traits, say)
    check_sequence_parallel_attention(cfg, model, layout)
    attach_images = vision.attach if vision is not None else None
    planner = make_planner(data.train.data, cfg, tokenizer.pad_token_id, layout, attach_images)

    def steps_from(start_step: int) -> StepGroups:
        return step_groups(planner, cfg.train.gradient_accumulation, start_step)

    fault = injected_fault()
    if fault is not None:  # the hang and resume tests' faults, around the engine and the data
        injector = FaultInjector(fault, info.rank, watchdog)
        injector.watch_phases()
        engine = injector.wrap_engine(engine)
        plain_steps = steps_from

        def steps_from(start_step: int) -> StepGroups:
            return injector.wrap_steps(plain_steps(start_step), start_step)

    if info.distributed:  # the module names label collectives; one process has none, and the hooks cost time
        RECORDER.track_modules(engine.unwrapped)
    validation = validation_split(cfg, data, tokenizer, layout, attach_images)
    reference_table = None
    if cfg.objective.reference_pass(cfg):
        reference_table = reference_pass(cfg, engine, data, tokenizer, layout, work_dir, watchdog, say)
    prompts = None
    if cfg.objective.prompted:
        if any(reward.needs_prompts for reward in rewards):
            watchdog.beat("model", training=False)  # weights loading: the start-up limit
            with forked_rng(info.device):  # a score head made before the adapter's replaces it draws
                load_reward_models(rewards, info.device, cfg.train.precision)
        prompts = PromptContext(
            cfg.rl,
            rewards,
            data.train.data.answers,
            tokenizer,
            template,
            cfg.train.seed,
            prompt_lookup(data.train.data),
            cfg.data.max_length,
        )
    objective = build_objective(
        engine,
        cfg.train.precision,
        balance,
        cfg.train.objective,
        cfg.preference,
        reference_table,
        reference_model,
        prompts,
    )
    return RunParts(
        cfg=cfg,
        work_dir=work_dir,
        tokenizer=tokenizer,
        template=template,
        engine=engine,
        moe=moe,
        planner=planner,
        steps_from=steps_from,
        watchdog=watchdog,
        objective=objective,
        validation=validation,
        layout=layout,
        flops_per_token=flops_per_token,
        run_id=run_id,
        images=vision.tokens if vision is not None else None,
    )


def check_engine(cfg: Config, chosen: EngineChoice, info: DistInfo, tokenizer, say: Say) -> None:
    """What the engine refuses of this run, checked before the model loads (from its config)."""
    if cfg.train.compile:
        chosen.traits.check_compile()
        check_compiler(info.device)
    problems, line = chosen.model_problems(cfg, lambda: model_config(cfg.model, tokenizer), info.world_size)
    if cfg.objective.prompted and (problem := generator_problem(cfg.rl, cfg.parallel.expert_parallel)):
        problems.append(problem)
    if problems:  # from the config and the launch: every rank finds the same
        raise SharedUserError("\n".join(problems))
    if line:
        say(line)


def frozen_reference(
    cfg: Config, engine: Engine, tokenizer, info: DistInfo, work_dir: Path, traits: EngineTraits, say: Say
) -> FrozenModel | None:
    """DPO's frozen copy of the model before training, held by the engine like the policy, where the objective
    asks for one."""
    if not cfg.objective.frozen_copy(cfg):
        return None
    # Loaded once the engine holds the policy, so a sharding engine has freed the policy's whole copy first.
    with forked_rng(info.device):
        copy = build_frozen_copy(cfg.model, tokenizer, cfg.train.seed, info, RunFiles(work_dir).base, traits.sharded)
    say(f"dpo reference: a frozen copy of the model before training, held like the policy ({traits.label})")
    return engine.frozen(copy)


def check_sequence_parallel_attention(cfg: Config, model: torch.nn.Module, layout: Layout) -> None:
    if layout.size > 1 and getattr(model.config, "_attn_implementation", None) != packed_attention.NAME:
        raise UserError(
            "parallel.sequence_parallel: this model does not use transformers' attention interface (remote code "
            "with its own attention), so its attention cannot be split across ranks; set parallel.sequence_parallel=1"
        )


def sequence_layout(cfg: Config, info: DistInfo, tokenizer, say: Say) -> Layout:
    """Where this rank sits in data and sequence parallelism; with `parallel.sequence_parallel` > 1, the checks
    that need only the model's config (before it loads) and the sequence-parallel process groups."""
    size = cfg.parallel.sequence_parallel
    if size == 1:
        return Layout.of(info.rank, info.world_size, 1)
    config = model_config(cfg.model, tokenizer).get_text_config()
    heads = config.num_attention_heads
    problems = unsupported(heads, getattr(config, "num_key_value_heads", None) or heads, info.world_size, size)
    if cfg.model.attn_implementation != "sdpa":
        problems.append(
            f"model.attn_implementation={cfg.model.attn_implementation}: it needs sdpa (tuneforge's packed attention)"
        )
    if problems:
        raise UserError(f"parallel.sequence_parallel={size}: " + "; ".join(problems))
    layout = init_groups(info.rank, info.world_size, size)
    say(
        f"sequence parallel: each row split across {size} ranks (all-to-all around attention, {heads // size} of "
        f"{heads} heads per rank); {layout.data_size} data-parallel group(s), train.micro_batch_size is per group"
    )
    return layout


def load_data(
    cfg: Config, tokenizer, template, info: DistInfo, say: Say, vision: VisionRun | None = None
) -> PreparedData:
    """Tokenized (or cached) splits with their reports printed; no trainable sample left is an error."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))  # the ranks on this node
    images = vision.tokens if vision is not None else None
    data = prepare_data(cfg.data, tokenizer, template, info.local_rank, local_ranks, cfg.paired, images, room_for(cfg))
    for split in (data.train, data.validation):
        if split is not None:
            split.report.padding = padding_by_strategy(split.data, cfg.train.micro_batch_size, cfg.data.max_length)
            say("\n".join(format_report(split.report)))
    if len(data.train.data) == 0:
        raise UserError(nothing_trains(data.train.report))
    return data


def preflight(cfg: Config, engine: EngineChoice, info: DistInfo, tokenizer, num_samples: int, say: Say) -> None:
    """The doctor's checks; a failed one stops the run unless `watchdog.doctor=warn`. The ranks agree on it first
    (a check of a host's hardware may fail on one node alone), so they stop together and rank 0 says it once."""
    checks = run_checks(cfg, engine, info.world_size, tokenizer, num_samples)
    say(format_checks(checks))
    if cfg.watchdog.doctor != "fail":
        return
    failed = [c for c in checks if c.status == FAIL]
    # A check whose reason names its own fix (expert parallelism's) has no separate one: its reason is said.
    refusal = "; ".join(f"{c.name}: {c.fix or c.detail}" for c in failed)
    # watchdog.doctor=warn goes past the doctor, not past what the run refuses by itself: offered only then.
    if failed and not any(c.binding for c in failed):
        refusal += " (watchdog.doctor=warn to go on)"
    refusals = gather_objects(refusal, info)
    rank, first = next(((r, text) for r, text in enumerate(refusals) if text), (0, ""))
    if first:
        where = f" (rank {rank})" if rank else ""
        raise SharedUserError(f"doctor{where}: {first}")


def trainable_model(
    cfg: Config, tokenizer, info: DistInfo, work_dir: Path, traits: EngineTraits, say: Say
) -> tuple[torch.nn.Module, MoEMap, RouterBalance | None, float]:
    """The loaded model made trainable (adapters or frozen parts), its MoE map (found on the base model before
    adapters wrap it), the router balance hooks, and the model FLOPs a token needs."""
    scalar_head = cfg.objective.scalar_head
    model = build_model(
        cfg.model, tokenizer, cfg.train.seed, info, RunFiles(work_dir).base, traits.sharded, scalar_head
    )
    architecture, model_config = type(model).__name__, model.config
    moe = find_moe(model)
    if moe:
        say(moe.describe())
    model, notes = make_trainable(model, cfg.model, cfg.train.gradient_checkpointing, moe)
    for note in notes:
        say(note)
    if cfg.train.compile:
        say(f"compile: {compile_elementwise(model)} norm and MLP modules compiled (the first step compiles them)")
    trainable, total = count_parameters(model)
    say(
        f"model: {architecture}, {total / 1e6:.2f}M parameters, {trainable / 1e6:.3f}M trainable "
        f"({100 * trainable / total:.2f}%), weights {cfg.model.dtype}, compute {cfg.train.precision}"
    )
    if info.is_main:
        check_disk_room(cfg, work_dir, total, trainable, say)
    balance, balance_note = attach_router_balance(moe, model_config, cfg.train.router_aux_loss_coef)
    if balance_note:
        say(balance_note)
    # Counted before an engine shards it; a reference's forward (no backward) is work the step does too.
    flops = model_flops_per_token(model, moe) + cfg.objective.extra_forwards(cfg) * forward_flops_per_token(model, moe)
    return model, moe, balance, flops


def check_disk_room(cfg: Config, work_dir: Path, total: int, trainable: int, say: Say) -> None:
    """Refuse a run whose first checkpoint cannot fit on the work dir's disk: better now than hours in."""
    saving = cfg.checkpoint.every_steps or cfg.checkpoint.save_final
    if not saving:
        return
    weight_bytes = torch.empty((), dtype=DTYPES[cfg.model.dtype]).element_size()
    needed = checkpoint_bytes(total, trainable, weight_bytes, cfg.model.lora is not None)
    errors, warnings = disk_room_problems(work_dir, needed, cfg.checkpoint.keep_last)
    if errors:
        raise UserError("\n".join(errors))
    for warning in warnings:
        say(warning)


def optimizer_for(cfg: Config) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
    """The optimizer of the model an engine holds: a vision-language model's parts with their own learning
    rates (`model.vision.tower_lr`, `projector_lr`) in groups of their own."""
    vision = settings_of(cfg.model)

    def build(model: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(model, cfg.train, part_learning_rates(model, vision, cfg.train.lr))

    return build


def validation_split(
    cfg: Config,
    data: PreparedData,
    tokenizer,
    layout: Layout,
    attach_images: Callable[[MicroBatch], MicroBatch] | None = None,
) -> list[MicroBatch] | None:
    if data.validation is not None and len(data.validation.data):
        return list(
            validation_batches(
                data.validation.data,
                cfg.train.micro_batch_size,
                tokenizer.pad_token_id,
                layout,
                cfg.data.packing,
                cfg.data.max_length,
                2 if cfg.paired else 1,
                # A precomputed reference's table holds the train split's answers first.
                len(data.train.data) if cfg.objective.reference_pass(cfg) else 0,
                attach_images,
            )
        )
    if cfg.checkpoint.keep_best:
        raise UserError(
            "checkpoint.keep_best needs a validation split: set data.validation_files or validation_fraction"
        )
    return None


def train_and_evaluate(parts: RunParts, info: DistInfo, say: Say, resume: str | None, resume_dir: Path | None) -> dict:
    """The loop from the start or a checkpoint, then the exact-match evaluation and the closing summary."""
    cfg, engine, work_dir = parts.cfg, parts.engine, parts.work_dir
    trainer = Trainer(parts)
    layout = parts.layout
    global_batch = cfg.train.micro_batch_size * cfg.train.gradient_accumulation * layout.data_size
    ranks = f"{info.world_size} rank(s)"
    if layout.size > 1:
        ranks = f"{layout.data_size} data-parallel group(s) of {layout.size} ranks, each row split across a group"
    say(
        f"train: {trainer.total_steps} optimizer steps of {cfg.train.gradient_accumulation} x "
        f"{cfg.train.micro_batch_size} {cfg.objective.batch_unit(cfg.data.packing)} "
        f"x {ranks} "
        f"= {global_batch} per step; lr {cfg.train.lr:g} ({cfg.train.schedule}, "
        f"{trainer.schedule.warmup_steps} warmup steps)"
    )
    planner = parts.planner
    rows = len(planner.packed_rows) if planner.packed_rows is not None else len(planner.unit_lengths)
    if rows < global_batch:
        unit = cfg.objective.batch_unit(cfg.data.packing)
        say(f"train: the data has {rows} {unit}, so a step takes {max(rows, layout.data_size)}, not {global_batch}")
    start = None
    if resume == "auto" and resume_dir is None:
        say("resume: no complete step checkpoint of this run in the work dir yet; starting from the beginning")
    if resume_dir is not None:
        start = resume_from(resume_dir, engine, trainer, cfg, info, work_dir)
        say(
            f"resumed from {resume_dir}: step {start.step} of {trainer.total_steps}, epoch {start.epoch}, "
            f"{start.samples_consumed} samples consumed"
        )
        per_epoch = steps_per_epoch(len(parts.planner), cfg.train.gradient_accumulation)
        if note := data_changed_note(start, resume_dir, parts.planner.data.signature(), per_epoch):
            say(note)
    # On CPU the steps' large activations are reused from the heap rather than mapped afresh each time.
    with freed_host_memory_kept(info.device.type == "cpu") as kept:
        if kept:
            say("host memory: freed blocks kept for reuse during training (glibc malloc, CPU)")
        history = trainer.run(start)
    summary: dict = {"steps": len(history), "final_loss": history[-1]["loss"] if history else None}
    if history and "val_loss" in history[-1]:
        summary["val_loss"] = history[-1]["val_loss"]
    if cfg.eval.exact_match is not None:
        summary["accuracy"] = evaluate_exact_match(parts, info, say)
    plot_line = plot_at_end(work_dir) if info.is_main and cfg.log.plot and history else None
    for line in closing_summary(history, work_dir, cfg):
        say(line)
    if plot_line:
        say(plot_line)
    barrier(info)
    return summary


def evaluate_exact_match(parts: RunParts, info: DistInfo, say: Say) -> float:
    cfg, engine, match_cfg = parts.cfg, parts.engine, parts.cfg.eval.exact_match
    parts.watchdog.beat("eval")
    # Every rank generates (no collectives for single/DDP; sharded engines need all ranks in lockstep).
    result = exact_match(
        engine.unwrapped,
        parts.tokenizer,
        parts.template,
        match_cfg.file,
        match_cfg.label,
        cfg.data.system,
        match_cfg.max_new_tokens,
        match_cfg.batch_size,
        cfg.train.precision,
        synced=engine.generates_in_lockstep,
        on_batch=lambda: parts.watchdog.beat("eval"),
        images=parts.images,
    )
    if info.is_main:
        write_result(result, RunFiles(parts.work_dir).eval_result)
    say(f"{result.label} accuracy: {result.accuracy:.3f}")
    say(f"({result.correct}/{result.total} exact matches; details in {RunFiles(parts.work_dir).eval_result})")
    return result.accuracy


def closing_summary(history: list[dict], work_dir: Path, cfg: Config) -> list[str]:
    """One screen at the end: time, tokens, losses, where the checkpoints are, what to run next."""
    if not history:
        return []
    last = history[-1]
    tokens = sum(r["tokens"] for r in history)
    trained = sum(r["trained_tokens"] for r in history)
    lines = [
        f"done: {len(history)} steps in {last['elapsed_s']:.0f}s, {tokens:,} tokens ({trained:,} trained); "
        f"final loss {last['loss']:.4f}"
    ]
    validated = [r for r in history if "val_loss" in r]
    if validated:
        best = min(validated, key=lambda r: r["val_loss"])
        lines[0] += (
            f", validation loss {validated[-1]['val_loss']:.4f} (best {best['val_loss']:.4f} at step {best['step']})"
        )
    overflows = sum(1 for r in history if r.get("overflow"))
    skipped = sum(1 for r in history if "skipped" in r) - overflows
    if skipped:
        lines.append(f"non-finite steps: {skipped} (see the lines above)")
    if overflows:
        lines.append(
            f"fp16 overflow steps skipped: {overflows} of {len(history)} (loss scale at the last step "
            f"{last['loss_scale']:g})"
        )
    checkpoints = RunFiles(work_dir).checkpoints
    final = checkpoints / "final"
    if cfg.checkpoint.save_final:
        lines.append(f"checkpoints: {checkpoints} (final model: {final})")
        if cfg.objective.writes_answers:  # a reward model scores; it does not chat
            lines.append(f"chat with it:  tuneforge chat {shlex.quote(str(final))}")
        merge = " --merge" if cfg.model.lora is not None else ""
        out = shlex.quote(str(work_dir / "export"))
        lines.append(f"export it:     tuneforge export {shlex.quote(str(final))} --out {out}{merge}")
    lines.append(f"metrics: {RunFiles(work_dir).metrics}")
    return lines
