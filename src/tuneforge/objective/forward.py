"""The model's forward pass over a micro-batch, set up once per run, and what the objectives read from it."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tuneforge.data.batching import MicroBatch
from tuneforge.data.templates import IGNORE_INDEX
from tuneforge.model.attention import model_inputs
from tuneforge.model.precision import AUTOCAST_DTYPES, autocast
from tuneforge.model.transfer import to_device
from tuneforge.objective.fused_loss import linear_cross_entropy_sum, plain_output_layer
from tuneforge.objective.log_probs import linear_target_log_probs, linear_target_log_probs_and_entropy


class TokenForward:
    """Runs micro-batches through the model. Everything that does not change between micro-steps (the device,
    the output layer to fuse with the loss, the autocast dtype) is decided here, once.

    `model` may be an engine's wrapper; `plain` is the Hugging Face model inside it (for its config and output
    layer). `fuse`: whether the engine leaves the output layer's weight whole after the forward
    (`EngineTraits.fuses_output_layer`), so the loss may apply it to the labelled tokens itself. `device`: where
    the forward computes (by default, where `plain`'s first parameter is)."""

    def __init__(
        self,
        model: torch.nn.Module,
        plain: torch.nn.Module,
        precision: str,
        fuse: bool = True,
        device: torch.device | None = None,
    ):
        self.model = model
        self.plain = plain
        self.precision = precision
        # The rank's device, from the engine: an engine that offloads parameters keeps them in host memory.
        self.device = device if device is not None else next(plain.parameters()).device
        self.head = fused_output_layer(plain) if fuse else None
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)

    @property
    def fused(self) -> bool:
        return self.head is not None

    def cross_entropy_sum(self, batch: MicroBatch) -> torch.Tensor:
        """Sum of cross-entropy over the batch's target tokens (fp32 reduction)."""
        targets = to_device(batch.targets, self.device)
        inputs = model_inputs(self.plain, batch, self.device)
        with autocast(self.precision, self.device):
            if self.head is None:
                logits = self.model(**inputs, use_cache=False).logits
                return F.cross_entropy(
                    logits.float().reshape(-1, logits.size(-1)),
                    targets.reshape(-1),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
            # The forward goes through the engine's wrapper as usual (its hooks and gradient sync stay intact),
            # computing logits for one position only; the loss takes the final hidden states from there.
            outputs = self.model(**inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True)
        weight = self.head.weight  # read after the forward: FSDP2 has gathered the root's parameters by now
        if isinstance(weight, DTensor):
            raise RuntimeError("the output layer's weight is still sharded after the forward; the fused loss needs it")
        # The labelled positions, found on the CPU copy of the targets: a boolean index on the GPU would wait for it.
        selected = to_device((batch.targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1), self.device)
        hidden = outputs.hidden_states[-1]
        hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, selected)
        wanted = targets.reshape(-1).index_select(0, selected)
        return linear_cross_entropy_sum(hidden, weight, wanted, self.autocast_dtype or weight.dtype)

    def target_log_probs(self, batch: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
        return self.target_log_probs_and_entropy(batch, temperature, with_entropy=False)[0]

    def target_log_probs_and_entropy(
        self, batch: MicroBatch, temperature: float = 1.0, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(target) at every labelled position, in the row-major order of `batch.targets != IGNORE_INDEX`
        (fp32). Through the chunked output layer where it is fused; else from the model's logits, a log-softmax
        over the labelled rows only. `temperature`: of the distribution completions were sampled from (logits
        divided by it), which online RL's ratio and gradient are taken under. With `with_entropy`, also each
        position's entropy of that distribution (no gradient; empty without it)."""
        selected = to_device((batch.targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1), self.device)
        wanted = to_device(batch.targets, self.device).reshape(-1).index_select(0, selected)
        inputs = model_inputs(self.plain, batch, self.device)
        with autocast(self.precision, self.device):
            if self.head is None:
                logits = self.model(**inputs, use_cache=False).logits
                rows = logits.reshape(-1, logits.size(-1)).index_select(0, selected).float() / temperature
                log_softmax = torch.log_softmax(rows, dim=-1)
                entropy = torch.empty(0, device=rows.device)
                if with_entropy:
                    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1).detach()
                return log_softmax.gather(1, wanted[:, None]).squeeze(1), entropy
            outputs = self.model(**inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True)
        weight = self.head.weight
        if isinstance(weight, DTensor):
            raise RuntimeError("the output layer's weight is still sharded after the forward; the fused loss needs it")
        hidden = outputs.hidden_states[-1]
        hidden = hidden.reshape(-1, hidden.size(-1)).index_select(0, selected)
        if temperature != 1.0:
            hidden = hidden / temperature  # (h / T) · W = (h · W) / T: the output layer is linear, without bias
        compute = self.autocast_dtype or weight.dtype
        if with_entropy:
            return linear_target_log_probs_and_entropy(hidden, weight, wanted, compute)
        return linear_target_log_probs(hidden, weight, wanted, compute), torch.empty(0, device=hidden.device)


LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}
"""Config settings (with the value that leaves the logits alone) of models whose forward changes the output
layer's logits before the loss: Gemma-2's softcapping, Cohere's scale, Granite's divisor."""


def fused_output_layer(plain: torch.nn.Module) -> torch.nn.Linear | None:
    """The output layer to fuse with the loss, or None where the model's own logits must be used: the
    forward has no `logits_to_keep` (older remote code), the layer is not a plain local `nn.Linear`, or the
    model transforms its logits after it (`LOGIT_TRANSFORMS`: the fused loss would train on other logits)."""
    base = plain.get_base_model() if hasattr(plain, "get_base_model") else plain
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return None
    config = getattr(base, "config", None)
    for name, neutral in LOGIT_TRANSFORMS.items():
        if getattr(config, name, neutral) not in (neutral, None):
            return None
    return plain_output_layer(base)
