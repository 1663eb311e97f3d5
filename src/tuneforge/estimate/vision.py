"""What a vision-language model adds to the estimate: its vision tower and projector (their parameters, and what
of them trains under `model.vision`), and the images a micro-batch row carries: their tokens in the language
model's row and the patches the tower runs over. Counted from the model's config and the data settings alone,
as the run's processor would count them, so nothing is downloaded.

One image per sample is assumed; a packed row holds as many samples as fit it, so as many images as their
tokens fit (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from tuneforge.config.schema import DataConfig
from tuneforge.data.image_tokens import IMAGE_SHARE_OF_ROW

QWEN_MAX_IMAGE_TOKENS = 16384
"""Qwen2.5-VL's and Qwen3-VL's image processors cap an image at 16,384 tokens (their `max_pixels`)."""
DEFAULT_IMAGE_TOKENS = 256
"""Tokens per image assumed for a family whose config gives no image and patch size."""


@dataclass(frozen=True)
class ImageShape:
    """One image as the model sees it."""

    tokens: int
    """Tokens standing for it in the language model's row."""
    patches: int
    """Positions the tower runs over (before Qwen's 2 x 2 merge or InternVL's pixel shuffle; with CLIP's and
    InternViT's class token)."""
    pixels: int
    """Input values the micro-batch carries for it (channels x pixels, and Qwen's two temporal frames)."""
    how: str
    """Where the count comes from, for the report."""


def _side(value) -> int:
    """A size given as one number or as (height, width) (InternVL's); square images."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def image_shape(config: PretrainedConfig, data: DataConfig) -> ImageShape:
    """The tokens and patches of one image for a vision-language `config`: from `data.image_max_pixels` for
    the families with a dynamic resolution (Qwen-VL), else the family's fixed count (LLaVA's CLIP grid, Gemma
    3's pooled 256, InternVL's one 448-pixel tile)."""
    vision = config.vision_config
    if getattr(vision, "patch_size", None) is None or (
        getattr(vision, "image_size", None) is None and not getattr(vision, "spatial_merge_size", None)
    ):  # a family counted another way: its config's image length, if it says one
        tokens = getattr(config, "image_seq_length", None) or DEFAULT_IMAGE_TOKENS
        return ImageShape(tokens, tokens, 3 * tokens * 14**2, f"assumed {tokens} (the model's config names no size)")
    patch = _side(vision.patch_size)
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None)
    channels = channels or getattr(vision, "num_channels", 3)
    merge = getattr(vision, "spatial_merge_size", None)
    if merge:  # Qwen-VL: an image's area sets its tokens, one per merge x merge patches
        per_token = (patch * merge) ** 2
        if data.image_max_pixels:
            tokens = max(1, data.image_max_pixels // per_token)
            how = f"data.image_max_pixels {data.image_max_pixels:,} at {per_token:,} pixels per token"
        else:
            tokens = min(QWEN_MAX_IMAGE_TOKENS, data.max_length // IMAGE_SHARE_OF_ROW)
            how = f"no data.image_max_pixels, so the default budget: 1/{IMAGE_SHARE_OF_ROW} of data.max_length"
        patches = tokens * merge**2
        temporal = getattr(vision, "temporal_patch_size", 1) or 1  # an image is its frame twice
        return ImageShape(tokens, patches, patches * channels * temporal * patch**2, how)
    side = _side(vision.image_size)
    grid = (side // patch) ** 2
    pixels = channels * side**2
    tokens_per_image = getattr(config, "mm_tokens_per_image", None)
    if tokens_per_image:  # Gemma 3: the SigLIP grid pooled to a fixed count
        return ImageShape(tokens_per_image, grid, pixels, f"{side}-pixel image, pooled (no pan-and-scan crops)")
    ratio = getattr(config, "downsample_ratio", None)
    if ratio:  # InternVL: each tile's grid pixel-shuffled; the class token runs through the tower
        tokens = int(grid * ratio**2)
        return ImageShape(tokens, grid + 1, pixels, f"one {side}-pixel tile, as the image processor crops none")
    cls = 1 if vision.model_type == "clip_vision_model" else 0  # CLIP's class token; LLaVA drops its feature
    tokens = grid + (cls if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if pinpoints:  # LLaVA-NeXT: the whole image and up to this many tiles of it (an upper bound: no unpadding)
        tiles = 1 + max((h // side) * (w // side) for h, w in pinpoints)
        how = f"{side}-pixel base image and up to {tiles - 1} tiles (image_grid_pinpoints)"
        return ImageShape(tiles * tokens, tiles * (grid + cls), tiles * pixels, how)
    return ImageShape(tokens, grid + cls, pixels, f"{side}-pixel image in {patch}-pixel patches")


def images_per_row(data: DataConfig, image: ImageShape) -> int:
    """Images in one micro-batch row: a sample's one, or for packed rows as many as their tokens fit."""
    if not data.packing:
        return 1
    return max(1, data.max_length // image.tokens)


@dataclass(frozen=True)
class VisionShapes:
    """A vision-language model's tower and projector, what of them trains, and the images of a row."""

    tower: int
    """Parameters of the tower (without Qwen's merger, which is the projector)."""
    projector: int
    tower_mode: str
    """`model.vision.tower`: frozen, full or lora."""
    projector_trains: bool
    language: str
    """How the language model trains: full, lora, partly (model.freeze) or frozen."""
    tower_trainable: int
    """Values the tower trains: all of it (in full), its adapters (lora), none (frozen)."""
    projector_trainable: int
    image: ImageShape
    images_per_row: int
    tower_patch_params: int
    """Tower parameters each patch multiplies with (its layers); the rest (Qwen3's deepstack mergers, patch
    and position embeddings) count per image token."""
    tower_token_params: int
    tower_adapter_active: float
    """Adapter parameters a patch multiplies with (tower: lora)."""
    tower_layers: int
    tower_hidden: int
    tower_act_total: float
    """Activation values a patch leaves for backward over all tower layers (no checkpointing)."""
    tower_act_max_layer: float
    projector_act: float
    """Activation values an image token leaves for backward in the projector."""

    @property
    def tower_trains(self) -> bool:
        return self.tower_mode != "frozen"

    @property
    def keeps_projector(self) -> bool:
        """The projector's activations are kept: it trains, or gradients pass through it to the tower."""
        return self.projector_trains or self.tower_trains

    def state(self) -> str:
        """The parts and what trains of each, for the report."""
        projector = "trained" if self.projector_trains else "frozen"
        return f"tower {self.tower_mode}, projector {projector}, language model {self.language}"
