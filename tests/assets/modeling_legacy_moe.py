"""A legacy-style MoE causal LM, loaded as remote code (`trust_remote_code`), for tests.

Like DeepSeek's remote code and old Mixtral, each layer's experts are a list of modules and only
the experts that receive tokens run. Under ZeRO-3 or per-expert sharding that makes ranks issue
different collectives unless the whole MoE block is one gathering unit.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class LegacyMoEConfig(PretrainedConfig):
    model_type = "legacy_moe"

    def __init__(
        self, vocab_size=260, hidden_size=32, num_hidden_layers=2, num_experts=4, experts_per_token=1, **kwargs
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        super().__init__(**kwargs)


class Expert(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


class LegacyMoEBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.experts_per_token
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.hidden_size) for _ in range(config.num_experts))

    def forward(self, hidden):
        flat = hidden.reshape(-1, hidden.shape[-1])
        weights, chosen = self.gate(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue  # the data-dependent skip that makes ranks diverge
            out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None])
        return out.reshape(hidden.shape)


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.moe = LegacyMoEBlock(config)

    def forward(self, hidden):
        # Causal token mixing: a running mean over earlier positions.
        steps = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)[None, :, None]
        hidden = hidden + self.mix(hidden.cumsum(1) / steps)
        return hidden + self.moe(self.norm(hidden))


class LegacyMoEForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LegacyMoEConfig
    _no_split_modules = ("Layer",)

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return CausalLMOutput(logits=self.lm_head(self.norm(hidden)))
