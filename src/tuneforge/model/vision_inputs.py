"""What a vision-language model's forward takes besides tokens, per family, chosen by the loaded model's structure.

Every family takes its image processor's tensors as they come (`pixel_values`, and `image_grid_thw`,
`image_sizes` or `num_patches` where the family has them). Qwen's multimodal rotary positions (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL: a model with `get_rope_index`) are computed here per sample, so packed rows restart them
at every sample as text positions restart: the model's own computation runs over whole rows and would number
a row's second sample after its first. They are computed on the CPU copy of the batch, from the model's own
`get_rope_index`, and travel as the 4-row form the model reads for packed input: the text positions (which the
attention splits samples by) above the three rotary rows.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from tuneforge.data.batching import MicroBatch
from tuneforge.model.packed_attention import sample_spans
from tuneforge.model.transfer import to_device


def _inner(model: nn.Module) -> nn.Module | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "model", None)


def vision_inputs(model: nn.Module, batch: MicroBatch, device: torch.device) -> dict[str, object]:
    """The forward's extra inputs for `batch` (whose `vision` is set), on `device`: the image processor's tensors
    that the forward takes (InternVL's `num_patches` is the processor's own), and each family's extras."""
    assert batch.vision is not None
    accepted = _forward_parameters(model)
    inputs: dict[str, object] = {
        name: to_device(value, device) for name, value in batch.vision.items() if name in accepted
    }
    inner = _inner(model)
    if inner is not None and hasattr(inner, "get_rope_index"):
        # Qwen-VL: which tokens are image tokens (Qwen3-VL refuses pixels without them), and rotary positions.
        image_token = inner.config.image_token_id
        inputs["mm_token_type_ids"] = to_device((batch.input_ids == image_token).int(), device)
        inputs["position_ids"] = to_device(rotary_positions(inner, batch), device)
    elif "token_type_ids" in accepted and _image_token(model) is not None:
        # Gemma 3: image tokens attend to each other both ways, told by their token type.
        inputs["token_type_ids"] = to_device((batch.input_ids == _image_token(model)).long(), device)
    return inputs


def bidirectional_images(model: nn.Module) -> bool:
    """Whether the model's image tokens attend to each other in both directions (Gemma 3), which causal attention
    over packed samples cannot give: such a model is refused packing."""
    return (
        _inner(model) is not None
        and not hasattr(_inner(model), "get_rope_index")
        and ("token_type_ids" in _forward_parameters(model))
    )


def _forward_parameters(model: nn.Module) -> frozenset[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _parameters_of(type(base))


@functools.cache
def _parameters_of(model_class: type) -> frozenset[str]:
    """The forward's parameter names, read once per class: this runs at every micro-step."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def _image_token(model: nn.Module) -> int | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "image_token_id", None)


def rotary_positions(inner: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """(4, rows, width): the text positions, then Qwen's three rotary rows computed sample by sample (each run of
    positions, padding included: a filler image sits in one)."""
    config = inner.config
    image_token = config.image_token_id
    merge = config.vision_config.spatial_merge_size
    grids = batch.vision.get("image_grid_thw") if batch.vision is not None else None
    tokens_per_image = (grids.prod(-1) // merge**2).tolist() if grids is not None else []
    rows, width = batch.input_ids.shape
    rotary = torch.zeros(3, rows, width, dtype=torch.long)
    taken = 0
    for row, spans in enumerate(sample_spans(batch.position_ids)):
        for start, end in spans:
            ids = batch.input_ids[row : row + 1, start:end]
            is_image = ids == image_token
            wanted, count = int(is_image.sum()), 0
            first = taken
            while count < wanted:
                count += tokens_per_image[taken]
                taken += 1
            span_grids = grids[first:taken] if taken > first else None
            positions, _ = inner.get_rope_index(ids, mm_token_type_ids=is_image.int(), image_grid_thw=span_grids)
            rotary[:, row, start:end] = positions[:, 0]
    return torch.cat([batch.position_ids[None], rotary])
