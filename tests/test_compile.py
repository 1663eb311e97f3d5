"""`train.compile`: compiled norms and MLPs train exactly like eager ones, on batches of changing width."""

from __future__ import annotations

import pytest
import torch

from tuneforge.config.schema import ParallelConfig, TrainConfig
from tuneforge.data.batching import collate
from tuneforge.engines import engine_traits
from tuneforge.errors import UserError
from tuneforge.model.compile import compile_elementwise

from conftest import accumulate, chat, rows_batch, single_engine, tiny_llama, tokenized

RECORDS = [chat("a" * 5, "short"), chat("b" * 30, "a longer reply " * 3), chat("c" * 12, "mid reply")]


@pytest.mark.slow  # torch.compile runs g++ (Inductor's C++ kernels): processes, and seconds of compiling
def test_compiled_layers_give_eager_losses_and_gradients(tokenizer):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    data = tokenized(tokenizer, RECORDS)
    pad = tokenizer.pad_token_id
    # Two widths: a packed row of all three samples, then padded rows of two: dynamic shapes, no failure.
    batches = [collate(data, [[0, 1, 2]], pad, packed=True), rows_batch(data, [0, 2], pad)]
    eager, compiled = tiny_llama(tokenizer, seed=1), tiny_llama(tokenizer, seed=1)
    assert compile_elementwise(compiled) == 2 * 3 + 1  # two norms and an MLP per layer, the final norm
    for batch in batches:
        expected = accumulate(single_engine(eager), [batch], "fp32")
        got = accumulate(single_engine(compiled), [batch], "fp32")
        assert got.loss == pytest.approx(expected.loss, abs=1e-6)
        for (name, mine), theirs in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-5, msg=name)
            mine.grad, theirs.grad = None, None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile, not fall back silently


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_compile_is_refused_where_untested(engine):
    with pytest.raises(UserError, match=f"parallel.engine single or ddp, not {engine}"):
        engine_traits(engine, ParallelConfig(), TrainConfig()).check_compile()
