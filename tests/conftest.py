"""Shared fixtures: tiny real models and the local byte tokenizer; nothing is downloaded."""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import socket
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tuneforge.data.byte_tokenizer import build_byte_tokenizer

REPO = Path(__file__).resolve().parent.parent
TUNEFORGE = str(Path(sys.executable).parent / "tuneforge")
"""The command users run, from this environment."""

TINY_MODELS = {
    "llama": "{architecture: llama, tokenizer: bytes, size: {hidden_size: 32, intermediate_size: 64, "
    "num_hidden_layers: 2, num_attention_heads: 4}}",
    "deepseek_v2": "{architecture: deepseek_v2, tokenizer: bytes, size: {hidden_size: 32, intermediate_size: 64, "
    "moe_intermediate_size: 16, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, "
    "n_routed_experts: 4, num_experts_per_tok: 2, n_shared_experts: 1, first_k_dense_replace: 1, kv_lora_rank: 16, "
    "q_lora_rank: null, qk_rope_head_dim: 8, qk_nope_head_dim: 8, v_head_dim: 8}}",
    "mixtral": "{architecture: mixtral, tokenizer: bytes, size: {hidden_size: 32, intermediate_size: 64, "
    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, num_local_experts: 4, "
    "num_experts_per_tok: 2}}",
    "qwen3_moe": "{architecture: qwen3_moe, tokenizer: bytes, size: {hidden_size: 32, intermediate_size: 64, "
    "moe_intermediate_size: 32, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, "
    "num_experts: 4, num_experts_per_tok: 2}}",
}
"""The `model:` section of a config for each tiny model the CLI tests train (a fresh model, the byte tokenizer)."""

TINY_LLAMA = f"model: {TINY_MODELS['llama']}\n"
"""The first line of a config that trains the tiny Llama."""

ENGINES = {
    "ddp": ["parallel.engine=ddp"],
    "fsdp": ["parallel.engine=fsdp"],
    "zero2": ["parallel.engine=deepspeed", "parallel.zero_stage=2"],
    "zero3_offload": ["parallel.engine=deepspeed", "parallel.zero_stage=3", "parallel.cpu_offload=all"],
}
"""Overrides that pick each multi-rank engine set-up the tests cover."""


class TierLeak(BaseException):
    """A test outside the `slow` tier trained, launched or started a process. A BaseException, so that the code
    under test (a CLI that turns errors into an exit code, a probe that falls back on failure) cannot swallow it;
    the test fails at its end all the same if it was (see `pytest_runtest_call`)."""


TIER_LEAKS = pytest.StashKey[list[str]]()
"""What a running test outside the `slow` tier did that belongs in it."""
_GUARDED: list[pytest.Item] = []
"""The test being run, while it is one the tier guard watches (set up, call and tear down)."""


def _guarded(item: pytest.Item) -> bool:
    # tests/gpu is its own tier (`make gpu-test`, skipped without a CUDA GPU): whole runs on the GPU by design.
    return item.get_closest_marker("slow") is None and REPO / "tests" / "gpu" not in Path(item.path).parents


def _leak(what: str, process: bool) -> None:
    if not _GUARDED:
        return
    item = _GUARDED[-1]
    trivial = item.get_closest_marker("trivial_process")
    if process and trivial is not None:
        if not trivial.args:
            raise TierLeak("@pytest.mark.trivial_process needs its reason: which process, and why it is trivial")
        return
    item.stash.setdefault(TIER_LEAKS, []).append(what)
    raise TierLeak(f"{item.nodeid} {what} outside the slow tier: mark it @pytest.mark.slow")


def _install_tier_guard() -> None:
    """Wraps what trains and what starts a process to call `_leak` first. subprocess.Popen covers run, call and
    check_output; multiprocessing's start covers torch's spawn and DataLoader workers."""
    import multiprocessing.process

    def wrap(owner, name: str, what, process: bool = True) -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "tier_guarded", False):
            return

        def guarded(*args, **kwargs):
            _leak(what(args, kwargs) if callable(what) else what, process)
            return original(*args, **kwargs)

        functools.update_wrapper(guarded, original)
        if isinstance(owner, types.ModuleType):  # pickled by reference (a hostile pickle's os.fork) as before
            guarded.__module__, guarded.__qualname__ = owner.__name__, name
        guarded.tier_guarded = True
        setattr(owner, name, guarded)

    def command(args, kwargs) -> str:
        argv = args[1] if len(args) > 1 else kwargs.get("args")
        words = argv.split() if isinstance(argv, str) else [str(a) for a in argv or []]
        return f"starts a process ({' '.join(words)[:120]})"

    wrap(subprocess.Popen, "__init__", command)
    wrap(os, "fork", "starts a process (os.fork)")
    wrap(multiprocessing.process.BaseProcess, "start", "starts a process (multiprocessing)")
    # The set-up of a training run (data, model, engine) and the loop; the refusals before it (inputs, resume, work
    # dir) are quick and stay in the fast tier. Wrapped once imported: importing them here would cost each pytest
    # run seconds.
    after_import["tuneforge.train.run"] = lambda m: wrap(m, "setup", "trains (a run's set-up)", process=False)
    after_import["tuneforge.train.loop"] = lambda m: wrap(m.Trainer, "run", "trains (Trainer.run)", process=False)
    for name, patch in after_import.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchAfterImport())


after_import: dict[str, Callable[[types.ModuleType], None]] = {}
"""Module name -> what to do to the module once it is imported."""


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs `after_import`'s patch of a module right after the module is first imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in after_import:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_and_patch(module, exec_module=exec_module):
                    exec_module(module)
                    after_import[fullname](module)

                spec.loader.exec_module = exec_and_patch
                return spec
        return None


def pytest_configure(config):
    _install_tier_guard()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The tier guard watches each test outside the `slow` tier from its set-up to its tear-down."""
    if _guarded(item):
        _GUARDED.append(item)
    try:
        return (yield)
    finally:
        if _GUARDED and _GUARDED[-1] is item:
            _GUARDED.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A leak the code under test caught and went on from still fails the test."""
    try:
        result = yield
    except TierLeak:
        raise
    except BaseException as exc:
        leaks = item.stash.get(TIER_LEAKS, None)
        if leaks:
            raise TierLeak(f"{item.nodeid} {leaks[0]} outside the slow tier: mark it @pytest.mark.slow") from exc
        raise
    leaks = item.stash.get(TIER_LEAKS, None)
    if leaks:
        raise TierLeak(f"{item.nodeid} {leaks[0]} outside the slow tier: mark it @pytest.mark.slow")
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    config: Path, work_dir: Path, *extra: str, ranks: int = 1, fault: str = "", timeout: float = 300
) -> subprocess.CompletedProcess:
    """`tuneforge train CONFIG --work-dir WORK_DIR EXTRA...` as users run it, with the launcher's flags for
    several ranks; `fault` goes to TUNEFORGE_INJECT_FAULT."""
    command = [TUNEFORGE, "train", str(config), "--work-dir", str(work_dir), *extra]
    if ranks > 1:
        command += ["--nproc-per-node", str(ranks), "--master-port", str(free_port())]
    env = {**os.environ, "TUNEFORGE_INJECT_FAULT": fault}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def tuneforge_here(*argv: str, fault: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`tuneforge ARGV...` in this process, through the same `main()` as the command, in `cwd` if given: for
    one-process commands that are not killed, without the seconds each new process spends importing torch and
    transformers."""
    import contextlib
    import io

    from tuneforge.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = os.environ.get("TUNEFORGE_INJECT_FAULT")
    os.environ["TUNEFORGE_INJECT_FAULT"] = fault
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd or Path.cwd()):
            code = main(list(argv))
    finally:
        if previous is None:
            del os.environ["TUNEFORGE_INJECT_FAULT"]
        else:
            os.environ["TUNEFORGE_INJECT_FAULT"] = previous
    return subprocess.CompletedProcess(["tuneforge", *argv], code, out.getvalue(), err.getvalue())


def train_here(config: Path, work_dir: Path, *extra: str, fault: str = "") -> subprocess.CompletedProcess:
    """`tuneforge train CONFIG --work-dir WORK_DIR EXTRA...` in this process (see `tuneforge_here`)."""
    return tuneforge_here("train", str(config), "--work-dir", str(work_dir), *extra, fault=fault)


def metrics(work_dir: Path) -> list[dict]:
    """The records of a run's `metrics.jsonl`."""
    return [json.loads(line) for line in (work_dir / "metrics.jsonl").open()]


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


TINY_DENSE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
"""Shapes of the tiny dense models (Llama, Mistral)."""


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **TINY_DENSE,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def tiny_mistral(tokenizer, sliding_window: int, seed: int = 0):
    """A tiny Mistral: the tiny Llama's shapes with a sliding attention window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=len(tokenizer), **TINY_DENSE, sliding_window=sliding_window, pad_token_id=tokenizer.pad_token_id
    )
    return MistralForCausalLM(config)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def chat(user: str, assistant: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant, **extra}]}


def tokenized(tokenizer, records: list[dict], template: str = "deepseek_coder", max_length: int = 1024, **data):
    """Records -> TokenizedData through the real format converters and template; asserts nothing is dropped."""
    from tuneforge.config.schema import DataConfig
    from tuneforge.data.formats import detect_format, to_conversation
    from tuneforge.data.report import DropLog
    from tuneforge.data.templates import get_template
    from tuneforge.data.tokenize import TokenizedData, tokenize

    cfg = DataConfig(train_files=["mem"], template=template, max_length=max_length, **data)
    conversations = [to_conversation(r, detect_format(r), f"mem:{i + 1}") for i, r in enumerate(records)]
    drops = DropLog()
    kept, _ = tokenize(conversations, tokenizer, get_template(cfg.template), max_length, cfg.truncation, None, drops)
    assert drops.total == 0, drops
    return TokenizedData.from_samples(kept)


def rows_batch(data, indices: list[int], pad_id: int):
    """One unpacked micro-batch of the given samples."""
    from tuneforge.data.batching import collate

    return collate(data, [[i] for i in indices], pad_id, packed=False)


TINY_DEEPSEEK_V2 = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
"""Shapes of the tiny DeepSeek-V2 (MLA attention, routed and shared experts, the first layer dense)."""


def tiny_deepseek_v2(tokenizer, seed: int = 0, attn_implementation: str = "sdpa"):
    """A tiny DeepseekV2 (MLA attention, routed + shared experts, first layer dense), native transformers code."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        **TINY_DEEPSEEK_V2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = attn_implementation
    return DeepseekV2ForCausalLM(config)


def single_engine(model):
    """The single-process engine around `model` (its optimizer is never stepped by these tests)."""
    from tuneforge.engines.single import SingleEngine

    return SingleEngine(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.0))


def trainable(model, cfg, gradient_checkpointing: bool):
    """`make_trainable` with the MoE map of `model` itself (a base nothing has wrapped yet)."""
    from tuneforge.model.moe import find_moe
    from tuneforge.model.trainable import make_trainable

    return make_trainable(model, cfg, gradient_checkpointing, find_moe(model))


def trained_lora(base, factors: str = "lora_B", **lora):
    """`base` with LoRA adapters (rank 4, alpha 8, no dropout unless `lora` says otherwise) made trainable as
    tuneforge does, their `factors` drawn at random so the adapter changes the model as a trained one does (PEFT
    starts from B = 0, a no-op). Returns `make_trainable`'s (model, notes)."""
    from tuneforge.config.schema import LoraSettings, ModelConfig

    settings = LoraSettings(**{"r": 4, "alpha": 8, "dropout": 0.0, **lora})
    model, notes = trainable(base, ModelConfig(architecture="llama", tokenizer="bytes", lora=settings), False)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if factors in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model, notes


def with_lora(model, settings):
    """`apply_lora` with the MoE map of `model` itself."""
    from tuneforge.model.adapters import apply_lora
    from tuneforge.model.moe import find_moe

    return apply_lora(model, settings, find_moe(model))


def accumulate(engine, batches, precision: str = "fp32", balance=None):
    """One step's gradients through `engine` with the SFT objective, as the training loop builds it."""
    from tuneforge.train.loop import accumulate_gradients
    from tuneforge.train.objectives import build_objective

    return accumulate_gradients(engine, batches, build_objective(engine, precision, balance))


def loss_sum(model, batch, precision: str = "fp32", fuse: bool = True):
    """The summed cross-entropy of `batch` through a plain model (no engine)."""
    from tuneforge.objective import TokenForward

    return TokenForward(model, model, precision, fuse).cross_entropy_sum(batch)


def tiny_mixtral(tokenizer, seed: int = 0):
    """A tiny Mixtral: 4 experts stacked in 3-D parameters, top-2 routing."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return MixtralForCausalLM(config)


def tiny_qwen3_moe(tokenizer, seed: int = 0):
    """A tiny Qwen3-MoE: 4 experts stacked in 3-D parameters, top-2 routing, every layer sparse."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen3MoeForCausalLM(config)


DEMO_TEMPLATE = {
    "system": "{system}\n",
    "instruction": "{input}\n",
    "suffix": "",
    "suffix_as_eos": False,
    "sep": "\n",
    "stop_words": [],
}
"""The demo's inline template as its checkpoints record it in tuneforge.json."""


def demo_tokenizer():
    return build_byte_tokenizer()


def adapter_checkpoint(directory: Path, trained: bool) -> Path:
    """A tiny Llama base and a LoRA adapter on it, written as training writes them; `trained`: its B matrices are
    not zero (an adapter fresh from initialisation changes nothing)."""
    from peft import LoraConfig, get_peft_model

    tokenizer = demo_tokenizer()
    base_dir, checkpoint = directory / "base", directory / "checkpoints" / "final"
    base = tiny_llama(tokenizer)
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    base.name_or_path = str(base_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if trained:
        torch.manual_seed(1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.5)
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    (checkpoint / "tuneforge.json").write_text(json.dumps({"template": DEMO_TEMPLATE, "system": None}))
    return checkpoint
