"""Per-token log-probabilities of the targets through the output layer, a chunk of rows at a time.

Preference objectives need log p(target) of every answer token, for the policy and the reference, with a
gradient that differs per token (it depends on the pair's other answer). Materialising the (tokens x vocab)
log-softmax for that is what makes preference training memory-bound in the usual tools; here the output layer is
applied to chunks of the labelled positions only. Forward keeps one log-sum-exp per token; backward recomputes
each chunk's logits (one more matmul) rather than keeping them, and turns them into the gradients with respect
to the hidden states and, when it trains, the weight.
"""

from __future__ import annotations

import torch

from tuneforge.objective.fused_loss import chunk_rows


class LinearTargetLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, compute_dtype, with_entropy):  # type: ignore[override]
        rows, vocab = hidden.size(0), weight.size(0)
        chunk = chunk_rows(rows, vocab, on_gpu=hidden.device.type != "cpu")
        log_probs = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        normalizers = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(rows if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            matrix = weight.to(compute_dtype)
            for start in range(0, rows, chunk):
                stop = min(start + chunk, rows)
                logits = (hidden[start:stop].to(compute_dtype) @ matrix.T).float()
                normalizer = torch.logsumexp(logits, dim=-1)
                normalizers[start:stop] = normalizer
                log_probs[start:stop] = logits.gather(1, targets[start:stop, None]).squeeze(1) - normalizer
                if with_entropy:  # H = log Z - sum(p * logits), from the chunk already in hand
                    expected = (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
                    entropy[start:stop] = normalizer - expected
                del logits
        ctx.save_for_backward(hidden, weight, targets, normalizers)
        ctx.compute_dtype = compute_dtype
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_output, _grad_entropy):  # type: ignore[override]
        hidden, weight, targets, normalizers = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, vocab = hidden.size(0), weight.size(0)
        chunk = chunk_rows(rows, vocab, on_gpu=hidden.device.type != "cpu")
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            matrix = weight.to(ctx.compute_dtype)
            for start in range(0, rows, chunk):
                stop = min(start + chunk, rows)
                part = hidden[start:stop].to(ctx.compute_dtype)
                upstream = grad_output[start:stop].float()
                # d log p(t) / d logits = one_hot(t) - softmax, times the upstream gradient of each row.
                gradient = (part @ matrix.T).float().sub_(normalizers[start:stop, None]).exp_()
                gradient.mul_(-upstream[:, None])
                gradient[torch.arange(stop - start, device=gradient.device), targets[start:stop]] += upstream
                gradient = gradient.to(ctx.compute_dtype)
                if need_hidden:
                    grad_hidden[start:stop] = gradient @ matrix
                if need_weight:
                    grad_weight += (gradient.T @ part).float()
                del gradient
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_target_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compute_dtype: torch.dtype
) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[row, targets[row]] for every row, in fp32; `hidden` is (rows, width) and
    holds only positions that have a target."""
    return LinearTargetLogProbs.apply(hidden, weight, targets, compute_dtype, False)[0]


def linear_target_log_probs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear_target_log_probs` and each row's entropy of softmax(hidden @ weight.T) (no gradient), the latter
    for online RL's figures."""
    return LinearTargetLogProbs.apply(hidden, weight, targets, compute_dtype, True)
