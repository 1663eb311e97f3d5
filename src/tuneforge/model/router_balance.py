"""The router's auxiliary load-balancing loss, for any MoE model whose routers output their logits.

Router logits, and the experts each router chose, are recorded with forward hooks on the routers of the
run's MoE map, rather than through `output_router_logits`: `transformers` then computes its own balance
loss from the attention mask, which breaks on the 4-D block-diagonal masks of packed batches, and
remote-code models differ in how they return it. Recording is switched on only around training forward
passes, so generation and activation recomputation during backward never add entries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tuneforge.errors import UserError
from tuneforge.model.moe import MoEMap
from tuneforge.model.transfer import to_device

DEFAULT_COEF = 0.001
"""The coefficient Mixtral, Qwen-MoE and DeepSeek-V2 were trained with."""


def routing_stats(
    logits: torch.Tensor, top_k: int, weights: torch.Tensor, chosen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignments per expert, summed router probability per expert) over the weighted tokens. `chosen`: the
    experts the router picked per token (tokens x top_k); None recomputes a softmax top-k, which is what
    greedy routers pick. The counts carry no gradient (routing is piecewise constant); the probability sums do."""
    probs = logits.reshape(-1, logits.size(-1)).float().softmax(dim=-1)
    weights = weights.to(probs.device)
    if chosen is None:
        chosen = probs.topk(top_k, dim=-1).indices
    chosen = chosen.reshape(-1)
    counts = torch.zeros(probs.size(-1), device=probs.device).index_add_(0, chosen, weights.repeat_interleave(top_k))
    return counts.detach(), (probs * weights[:, None]).sum(dim=0)


def combine(counts: torch.Tensor, prob_sums: torch.Tensor, real_tokens: float) -> torch.Tensor:
    """Switch-Transformer balance loss per layer from (layers, experts) statistics, averaged over layers:
    num_experts * sum_i (assignments to i / tokens) * (mean probability of i). It equals top_k when routing
    is perfectly balanced, as in `transformers`."""
    num_experts = counts.size(-1)
    per_layer = num_experts * ((counts / real_tokens) * (prob_sums / real_tokens)).sum(dim=-1)
    return per_layer.mean()


class RouterBalance:
    """Records router logits during `capture()` and turns them into the balance loss of that forward."""

    def __init__(self, routers: list[nn.Module], num_experts: int, top_k: int, coef: float, greedy: bool = True):
        self.num_experts = num_experts
        self.top_k = top_k
        self.coef = coef
        self.greedy = greedy
        """Whether a softmax top-k reproduces the routing, for routers that return only their logits."""
        self._recording = False
        self._logits: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._handles = [router.register_forward_hook(self._record) for router in routers]

    def _record(self, _module: nn.Module, _inputs: object, output: object) -> None:
        if not self._recording:
            return
        outputs = output if isinstance(output, tuple) else (output,)
        tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
        logits = next((t for t in tensors if t.is_floating_point() and t.size(-1) == self.num_experts), None)
        chosen = next((t for t in tensors if not t.is_floating_point() and t.size(-1) == self.top_k), None)
        if logits is None or outputs[0] is not logits:
            raise UserError(
                "train.router_aux_loss_coef: this model's router does not return its logits first; "
                "set train.router_aux_loss_coef=0"
            )
        if chosen is None and not self.greedy:
            raise UserError(
                "train.router_aux_loss_coef: this model's router returns its logits but not the experts it chose, "
                "and its routing is not a plain top-k; set train.router_aux_loss_coef=0"
            )
        self._logits.append((logits, chosen))

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        self._logits = []
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def loss(
        self,
        token_mask: torch.Tensor,
        num_targets: int,
        total_targets: float,
        sum_across_ranks: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """This rank's part of the balance loss of the global micro-batch (this micro-batch on every rank),
        weighted by that micro-batch's share of the step's target tokens. Routing counts and token counts are
        summed over ranks in one small collective, so the loss, like the language-model loss, does not depend
        on how the global batch is split across ranks; summed over ranks, the parts give the whole."""
        logits, self._logits = self._logits, []
        if not logits:
            raise RuntimeError("no router logits were recorded in this forward pass")
        device = logits[0][0].device
        # The mask and its count come from the CPU batch; the sums stay on the device (no host round trip).
        weights = to_device(token_mask.reshape(-1).float(), device)
        stats = [routing_stats(layer, self.top_k, weights, chosen) for layer, chosen in logits]
        counts = torch.stack([c for c, _ in stats])
        prob_sums = torch.stack([p for _, p in stats])
        totals = to_device(torch.tensor([float(token_mask.sum()), float(num_targets)], dtype=torch.float64), device)
        summed = sum_across_ranks(torch.cat([counts.flatten().double(), totals]))
        global_counts = summed[:-2].to(counts.dtype).view_as(counts)
        real_tokens = summed[-2].clamp(min=1.0).float()
        return combine(global_counts, prob_sums, real_tokens) * (summed[-1].float() / total_targets)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def rehook(self, routers: list[nn.Module]) -> None:
        """Record from `routers` instead: an engine that replaced the MoE blocks (expert parallelism) has new
        ones, whose outputs are the same logits."""
        self.remove()
        self._handles = [router.register_forward_hook(self._record) for router in routers]


def attach_router_balance(
    moe: MoEMap, config: object, requested_coef: float | None
) -> tuple[RouterBalance | None, str]:
    """Hooks for the balance loss on the routers of `moe` (the run's MoE map), and a line saying what was
    chosen. `config`: the model config. `requested_coef` None takes the model config's `router_aux_loss_coef`,
    else DEFAULT_COEF; 0 turns the loss off."""
    blocks = list(moe)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a vision-language model's routers are its language model's
    if not blocks:
        if requested_coef:
            raise UserError("train.router_aux_loss_coef: the model has no MoE layers; remove the setting")
        return None, ""
    coef = requested_coef
    source = "train.router_aux_loss_coef"
    if coef is None:
        configured = getattr(config, "router_aux_loss_coef", None)
        coef, source = (configured, "the model config") if configured is not None else (DEFAULT_COEF, "default")
    if coef == 0:
        return None, "router balance loss: off (train.router_aux_loss_coef=0)"
    top_k = moe.top_k
    if top_k is None and requested_coef is None:
        return None, "router balance loss: off (the model config has no num_experts_per_tok)"
    if top_k is None:
        raise UserError(
            "train.router_aux_loss_coef: the model config has no num_experts_per_tok, so the balance loss "
            "cannot tell how many experts each token uses; set train.router_aux_loss_coef=0"
        )
    counts = {block.num_experts for block in blocks}
    if len(counts) != 1:
        raise UserError(f"train.router_aux_loss_coef: MoE layers with different expert counts {sorted(counts)}")
    greedy = all(block.routing.startswith("softmax") for block in blocks)
    balance = RouterBalance(moe.routers(), counts.pop(), int(top_k), float(coef), greedy)
    routing = "; ".join(sorted({block.routing for block in blocks}))
    return balance, (
        f"router balance loss: coefficient {coef:g} ({source}) over {len(blocks)} MoE layers, top-{top_k} routing "
        f"({routing}), counted on the experts each router chose"
    )
