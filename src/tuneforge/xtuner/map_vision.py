"""xtuner's vision-language configs: `LLaVAModel` (a causal language model, a CLIP vision tower and a fresh
projector, trained in xtuner's two stages) and `InternVL_V1_5` (a whole InternVL checkpoint), with their datasets
(`LLaVADataset`, `InternVL_V1_5_Dataset`).

What trains becomes `model.vision`: xtuner's `freeze_llm` / `llm_lora` the language model (`language`, and
`model.lora`), `freeze_visual_encoder` / `visual_encoder_lora` the tower (`tower`, `tower_lora`); the projector
always trains in xtuner, so `projector: full`. A LLaVA config keeps being assembled from its parts, as xtuner does
in both stages: `model.path` is the language model and `model.vision.tower_path` the tower.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NoReturn

from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import Call, Symbol
from tuneforge.xtuner.map_data import TRUNCATION_DIFFERENCE, DataMapping
from tuneforge.xtuner.map_model import ModelMapping
from tuneforge.xtuner.mapper_base import shown, type_name

VISION_MODELS = ("LLaVAModel", "InternVL_V1_5")
"""xtuner's vision-language model wrappers, mapped here."""
TOWER_CLASSES = ("CLIPVisionModel", "SiglipVisionModel")
"""Vision towers tuneforge assembles a LLaVA model with (`model.vision.tower_path`)."""
WHOLE_VLM_CLASSES = ("LlavaForConditionalGeneration", "AutoModelForImageTextToText", "AutoModelForVision2Seq")
"""Loaders of a whole Hugging Face vision-language model: `model.path` loads such a checkpoint as it is."""
LLAVA_PROJECTOR_DEPTH = 2
LLAVA_FEATURE_LAYER = -2
"""xtuner's LLaVAModel defaults, which are LLaVA-1.5's and the LLaVA architecture's tuneforge builds: a projector
of two linear layers with a GELU between, fed by the tower's second-to-last layer."""
INTERNVL_SYSTEMS = {
    "internlm2_chat": "You are an AI assistant whose name is InternLM (书生·浦语).",
    "phi3_chat": "You are an AI assistant whose name is Phi-3.",
}
"""The system prompt xtuner 0.1.23's InternVL_V1_5_Dataset gives every conversation, by the language model it
finds (InternLM2 or Phi-3), which the gallery's `template` names."""
INTERNVL_QUANTIZATION = {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
"""InternVL_V1_5's `quantization_llm`: xtuner's fixed BitsAndBytesConfig (NF4, double quantization, float16
compute, which becomes bfloat16 as the weights do)."""
LLAVA_MAP_DIFFERENCE = (
    "dataset_map_fn llava_map_fn -> format sharegpt (LLaVA's `image` + `conversations` records), which differs from "
    "it in where an image goes: xtuner moves a message's <image> to its start, followed by a newline; tuneforge "
    "keeps each <image> where the data writes it (LLaVA's released data writes it first or last), and drops a "
    "record that starts with an assistant message (xtuner skips the message)"
)
PAD_TO_SQUARE = (
    "tuneforge gives each image to the processor as it is, which resizes its short side and center-crops it "
    "(CLIP's processor); xtuner first pads it to a square in the processor's mean color, so nothing is cropped. "
    "To match, pad the images to squares before training"
)
ONE_IMAGE_ROOT = (
    "an image folder for each data file; tuneforge resolves the images of every file against one data.image_root: "
    "write the image paths in the data relative to one folder (or absolute) and set data.image_root to it"
)
INTERNVL_FORMAT = (
    "tuneforge loads InternVL through transformers' own InternVLForConditionalGeneration (no remote code), which "
    "reads checkpoints in transformers' format only: the `-hf` repositories such as OpenGVLab/InternVL3-2B-hf. "
    "InternVL-Chat-V1-5, Mini-InternVL and InternVL2 have no such form, and transformers' converter "
    "(models/internvl/convert_internvl_weights_to_hf.py in its repository) covers InternVL2.5 and InternVL3; "
    "set model.path to an `-hf` checkpoint"
)


def loader_class(value: Any) -> str:
    """`CLIPVisionModel` for `CLIPVisionModel.from_pretrained`; the type's own name otherwise."""
    if isinstance(value, Symbol) and value.path.endswith(".from_pretrained"):
        return value.path.rsplit(".", 2)[-2]
    return type_name(value)


def image_tokens(tower: str) -> int | None:
    """The tokens an image becomes in a LLaVA model with this tower, read from a CLIP or SigLIP checkpoint's
    conventional name (`clip-vit-large-patch14-336`: (336 / 14)^2 = 576); None when the name does not say."""
    name = Path(tower).name.lower()
    match = re.search(r"patch(\d+)(?:-(\d+))?", name)
    if match is None or int(match[1]) == 0:
        return None
    size = int(match[2]) if match[2] else 224 if "clip" in name else None  # OpenAI's CLIP without a size: 224
    return (size // int(match[1])) ** 2 if size else None


def internvl_format(path: str) -> bool | None:
    """True for an InternVL checkpoint in transformers' format, False for one of InternVL's remote code, None when
    the path does not say (a hub id without `-hf`)."""
    config = Path(path) / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type is not None:
        return model_type == "internvl"
    return True if path.rstrip("/").endswith("-hf") else None


def local(path: str) -> str:
    """A directory that exists here, resolved from where xtuner would have been started; a hub id as is."""
    return str(Path(path).resolve()) if Path(path).is_dir() else path


class VisionMapping(ModelMapping, DataMapping):
    image_tokens: int | None = None
    """Tokens per image of the LLaVA being assembled, for converting xtuner's max_length (None: unknown)."""
    internvl_path: str | None = None
    """The `model_path` of an InternVL_V1_5 model, which its dataset names too."""

    def note(self, text: str) -> None:
        """A conversion note, said once however many datasets of a ConcatDataset share it."""
        if text not in self.result.notes:
            self.result.notes.append(text)

    def refuse(self, call: Call, key: str, what: str, why: str) -> NoReturn:
        raise UserError(f"{self.path}:{self.line(call, key)}: {what} cannot be carried over: {why}")

    # -- models ----------------------------------------------------------------------------------------------
    def map_vision_model(self, model: Call, kind: str, tokenizer: Any) -> None:
        if kind == "LLaVAModel":
            self.map_llava(model, tokenizer)
        else:
            self.map_internvl(model)

    def map_trainable(self, model: Call) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
        """What of the model trains: `model.vision` without its paths, the language model's adapters, and the
        sentence that says so.

        Both wrappers freeze a part whose `freeze_*` is True (their default: False, trained in full), and an
        adapter config trains adapters on that part, its base frozen, whatever its `freeze_*` says."""
        freeze_llm, freeze_tower = self.take(model, "freeze_llm"), self.take(model, "freeze_visual_encoder")
        llm_lora, tower_lora = self.take(model, "llm_lora"), self.take(model, "visual_encoder_lora")
        lora = self.map_lora(llm_lora, "llm_lora") if isinstance(llm_lora, Call) else None
        if llm_lora is not None and lora is None:
            self.unmapped(self.line(model, "llm_lora"), f"llm_lora = {shown(llm_lora)}", "not a LoraConfig dict")
        vision: dict[str, Any] = {"tower": "frozen" if freeze_tower else "full", "projector": "full"}
        vision["language"] = "train" if lora is not None or not freeze_llm else "frozen"
        if isinstance(tower_lora, Call):
            vision["tower"] = "lora"
            vision["tower_lora"] = self.map_lora(tower_lora, "visual_encoder_lora", "model.vision.tower_lora", False)
        elif tower_lora is not None:
            line = self.line(model, "visual_encoder_lora")
            self.unmapped(line, f"visual_encoder_lora = {shown(tower_lora)}", "not a LoraConfig dict")
        if freeze_llm and lora is not None:
            self.note("freeze_llm with llm_lora: the language model's base stays frozen; its adapters train")
        how = {"frozen": "frozen", "full": "in full", "lora": "through LoRA (model.vision.tower_lora)"}
        language = "in full" if vision["language"] == "train" else "frozen"
        trains = (
            f"it trains the tower {how[vision['tower']]}, the projector in full (always, in xtuner) and the language "
            f"model {'through LoRA (model.lora)' if lora is not None else language}"
        )
        return vision, lora, trains

    def map_llava(self, model: Call, tokenizer: Any) -> None:
        """LLaVAModel: `model.path` the language model, `model.vision.tower_path` the vision tower, a fresh
        projector, or the stage-1 one (`pretrained_pth`)."""
        llm = model.get("llm")
        if not isinstance(llm, Call) or not isinstance(llm.get("pretrained_model_name_or_path"), str):
            why = "not a from_pretrained dict of a language model with a path; set model.path yourself"
            self.refuse(model, "llm", f"model.llm = {shown(llm)}", why)
        tower = self.map_tower(model)
        projector = self.take(model, "pretrained_pth")
        if (depth := self.take(model, "projector_depth")) not in (None, LLAVA_PROJECTOR_DEPTH):
            why = "tuneforge's LLaVA projector is LLaVA-1.5's two linear layers with a GELU (xtuner's default, 2)"
            self.refuse(model, "projector_depth", f"model.projector_depth = {shown(depth)}", why)
        if (layer := self.take(model, "visual_select_layer")) not in (None, LLAVA_FEATURE_LAYER):
            why = "tuneforge's LLaVA reads the tower's second-to-last layer (-2, xtuner's default)"
            self.unmapped(self.line(model, "visual_select_layer"), f"model.visual_select_layer = {shown(layer)}", why)
        vision, lora, trains = self.map_trainable(model)
        # The language model as a text one (path, dtype, quantization, checkpointing); a frozen one is not quantized.
        self.map_model(model, tokenizer, quantize=lora is not None)
        out = self.section("model")
        if lora is not None:
            out["lora"] = lora
        elif isinstance(llm.get("quantization_config"), Call):
            self.unmapped_quantization(llm, vision["language"])
        out["vision"] = {"tower_path": tower, **vision}
        if projector is not None:
            self.map_projector(model, projector, out["vision"])
        self.image_tokens = image_tokens(tower)
        stage = "1, projector pretraining" if vision["language"] == "frozen" and vision["tower"] == "frozen" else "2"
        self.note(
            f"LLaVAModel (stage {stage}) -> a LLaVA model assembled from model.path (the language model) and "
            "model.vision.tower_path (the vision tower), with a projector of LLaVA-1.5's shape, "
            + ("loaded from model.vision.projector_weights; " if projector is not None else "started fresh; ")
            + trains
        )

    def map_tower(self, model: Call) -> str:
        tower = self.take(model, "visual_encoder")
        if not isinstance(tower, Call):
            self.refuse(model, "visual_encoder", f"model.visual_encoder = {shown(tower)}", "not a model dict")
        kind = loader_class(tower.type)
        if kind not in TOWER_CLASSES:
            why = f"tuneforge assembles LLaVA with a tower that {' or '.join(TOWER_CLASSES)} loads"
            self.refuse(tower, "type", f"model.visual_encoder type {kind}", why)
        path = self.take(tower, "pretrained_model_name_or_path")
        if not isinstance(path, str):
            why = "not a path; set model.vision.tower_path yourself"
            self.refuse(tower, "pretrained_model_name_or_path", f"model.visual_encoder path {shown(path)}", why)
        self.take(tower, "trust_remote_code")  # CLIP and SigLIP are transformers' own
        if self.take(tower, "torch_dtype") is not None:
            self.note("model.visual_encoder.torch_dtype: the tower is held in model.dtype with the rest of the model")
        if (quantization := self.take(tower, "quantization_config")) is not None:
            what = f"model.visual_encoder.quantization_config = {shown(quantization)}"
            self.unmapped(self.line(tower, "quantization_config"), what, "tuneforge keeps the vision tower 16-bit")
        self.leftovers(tower, "model.visual_encoder")
        return local(path)

    def unmapped_quantization(self, llm: Call, language: str) -> None:
        """xtuner loads a frozen language model in 4 bits for projector pretraining; tuneforge quantizes only one
        that trains through adapters (QLoRA), so such a model is held in 16 bits."""
        line = self.line(llm, "quantization_config")
        if language == "frozen":
            why = (
                "tuneforge quantizes a language model that trains through adapters (model.lora: QLoRA) only; this "
                "frozen one is held in model.dtype, 16-bit: about 4x the memory of its 4-bit weights"
            )
        else:
            why = "quantized weights cannot be trained in full; add llm_lora (model.lora) for QLoRA"
        self.unmapped(line, "model.llm.quantization_config", why)

    def map_projector(self, model: Call, projector: Any, vision: dict[str, Any]) -> None:
        line = self.line(model, "pretrained_pth")
        if not isinstance(projector, str):
            self.unmapped(line, f"model.pretrained_pth = {shown(projector)}", "not a path; set projector_weights")
            return
        vision["projector_weights"] = str(Path(projector).expanduser().resolve())
        directory = Path(projector).is_dir()
        self.note(
            f"model.pretrained_pth (line {line}) -> model.vision.projector_weights, resolved from the current "
            "directory: it must be the stage-1 projector's weights file (an xtuner .pth of tensors, or "
            ".safetensors). xtuner writes iter_N.pth as a DeepSpeed checkpoint directory when it trained with "
            "--deepspeed" + (" (this one is a directory)" if directory else "") + ": then `xtuner convert "
            "pth_to_hf STAGE1_CONFIG iter_N.pth OUT --safe-serialization` writes the projector to "
            "OUT/projector/model.safetensors, the file to give"
        )

    def map_internvl(self, model: Call) -> None:
        """InternVL_V1_5: the whole checkpoint at `model_path`, loaded in bf16 with its remote code by xtuner."""
        path = self.take(model, "model_path")
        if not isinstance(path, str):
            self.refuse(model, "model_path", f"model.model_path = {shown(path)}", "not a path; set model.path yourself")
        self.internvl_path = path
        out = self.section("model")
        out["path"], out["trust_remote_code"], out["dtype"] = local(path), False, "bfloat16"
        line = self.line(model, "model_path")
        if internvl_format(local(path)):
            self.note(f"model.model_path (line {line}) -> model.path: InternVL in transformers' format")
        else:
            self.unmapped(line, f"model.model_path = {path!r} (kept as model.path)", INTERNVL_FORMAT)
        vision, lora, trains = self.map_trainable(model)
        self.note(f"InternVL_V1_5 -> the InternVL checkpoint at model.path; {trains}")
        if lora is not None:
            out["lora"] = lora
            self.note_remote_names(lora.get("targets"), "model.lora")
        if isinstance(vision.get("tower_lora"), dict):
            self.note_remote_names(vision["tower_lora"].get("targets"), "model.vision.tower_lora")
        if self.take(model, "quantization_llm"):
            if lora is None:
                what = "quantization_llm = True"
                self.unmapped(self.line(model, "quantization_llm"), what, "needs llm_lora (QLoRA), as xtuner asserts")
            else:
                out["quantization"] = dict(INTERNVL_QUANTIZATION)
                self.note(
                    "quantization_llm -> model.quantization: xtuner's fixed NF4 with double quantization; its "
                    "float16 compute dtype -> bfloat16, as the weights; the tower and the projector stay 16-bit"
                )
        if self.take(model, "quantization_vit"):
            line = self.line(model, "quantization_vit")
            self.unmapped(line, "quantization_vit = True", "tuneforge keeps the vision tower 16-bit")
        if (weights := self.take(model, "pretrained_pth")) is not None:
            self.unmapped(
                self.line(model, "pretrained_pth"),
                f"model.pretrained_pth = {shown(weights)}",
                "xtuner's checkpoint of whatever InternVL_V1_5 trained; model.vision.projector_weights takes a "
                "projector only: merge it into the checkpoint and set model.path",
            )
        out["vision"] = vision
        self.section("train")["gradient_checkpointing"] = True
        self.note("InternVL_V1_5 always checkpoints activations -> train.gradient_checkpointing: true")
        self.leftovers(model, "model")

    def note_remote_names(self, targets: Any, where: str) -> None:
        if isinstance(targets, list):
            self.note(
                f"{where}.targets {targets}: names of InternVL's remote code (InternViT's attn.qkv, InternLM2's "
                "wqkv...); transformers' InternVL names its modules otherwise (attention.q_proj, self_attn.q_proj...): "
                "check them against the -hf checkpoint"
            )

    def map_whole_vlm(self, model: Call) -> None:
        """xtuner's SupervisedFinetune (or a preference wrapper) of a whole vision-language checkpoint (llava-hf
        and the like): `model.path` loads it as it is. Without adapters xtuner trains every weight, the tower's too;
        with them, its LoraConfig adapts whichever linear layers it names, which model.lora puts on the language
        model only."""
        llm = model.get("llm")
        kind = loader_class(llm.type) if isinstance(llm, Call) else None
        if kind not in WHOLE_VLM_CLASSES:
            return
        if model.get("lora") is None:
            self.section("model")["vision"] = {"tower": "full", "projector": "full", "language": "train"}
            trains = "xtuner trains all of it -> model.vision: the tower, the projector and the language model in full"
        else:
            trains = (
                "model.lora adapts its language model, the tower stays frozen and the projector trains in full "
                "(model.vision's defaults); xtuner's LoraConfig adapts the tower's and the projector's linear layers "
                "too where its target_modules name them: set model.vision.tower: lora to match"
            )
        self.note(f"model.llm type {kind}: a whole vision-language model; model.path loads it as one; {trains}")

    # -- datasets --------------------------------------------------------------------------------------------
    def map_other_dataset(self, dataset: Call, kind: str) -> bool:
        if kind == "LLaVADataset":
            self.map_llava_dataset(dataset)
        elif kind == "InternVL_V1_5_Dataset":
            self.map_internvl_dataset(dataset)
        else:
            return False
        return True

    def map_image_root(self, folder: Any, line: int, what: str) -> None:
        if folder is None:
            return
        if not isinstance(folder, str):
            self.unmapped(line, f"{what} = {shown(folder)}", "not a path; set data.image_root")
            return
        resolved, first = str(Path(folder).expanduser().resolve()), self.section("data").get("image_root")
        if first is not None and first != resolved:
            self.unmapped(line, f"{what} = {folder!r}", f"{ONE_IMAGE_ROOT}; data.image_root is the first one, {first}")
            return
        self.section("data")["image_root"] = resolved
        self.note("image folders resolved from the current directory, as xtuner reads them -> data.image_root")

    def map_llava_dataset(self, dataset: Call) -> None:
        data = self.take(dataset, "data_path")
        offline = self.take(dataset, "offline_processed_text_folder")
        if offline is not None:
            why = "xtuner's pre-tokenized copy of the data; tuneforge tokenizes data_path itself (and caches it)"
            self.unmapped(self.line(dataset, "offline_processed_text_folder"), "offline_processed_text_folder", why)
        if data is not None:
            line, fix = self.line(dataset, "data_path"), "set data.train_files"
            if (paths := self.strings(data, line, "LLaVADataset.data_path", fix)) is not None:
                resolved = [str(Path(f).expanduser().resolve()) for f in paths]
                self.section("data").setdefault("train_files", []).extend(resolved)
        self.map_image_root(self.take(dataset, "image_folder"), self.line(dataset, "image_folder"), "image_folder")
        self.map_image_processor(dataset)
        map_fn = self.take(dataset, "dataset_map_fn")
        name = type_name(map_fn) if map_fn is not None else None
        line = self.line(dataset, "dataset_map_fn")
        if name in ("llava_map_fn", "llava_image_only_map_fn"):
            self.put("format", "sharegpt", line)
            self.note(LLAVA_MAP_DIFFERENCE)
            if name == "llava_image_only_map_fn":
                why = "xtuner drops the user's text and keeps the image alone; remove the text from the data to match"
                self.unmapped(line, "dataset_map_fn = llava_image_only_map_fn", why)
        elif map_fn is not None:
            fix = "a custom map function; convert the data to LLaVA's image + conversations records (sharegpt)"
            self.unmapped(line, f"dataset_map_fn = {name}", fix)
        self.map_template_fn(dataset)
        if (length := self.number(dataset, "max_length", "LLaVADataset")) is not None:
            line = self.line(dataset, "max_length")
            self.put("max_length", self.llava_max_length(int(length), line), line)
            self.note(TRUNCATION_DIFFERENCE)
        said = any(what == "pad_image_to_square = True" for _, what, _ in self.result.unmapped)
        if self.take(dataset, "pad_image_to_square") and not said:  # once for all the parts of a ConcatDataset
            self.unmapped(self.line(dataset, "pad_image_to_square"), "pad_image_to_square = True", PAD_TO_SQUARE)
        if (cap := self.take(dataset, "max_dataset_length")) is not None:
            why = "xtuner trains on that many records of the file at most, picked at random; cut the file to match"
            self.unmapped(self.line(dataset, "max_dataset_length"), f"max_dataset_length = {shown(cap)}", why)
        self.take(dataset, "tokenizer")
        self.leftovers(dataset, "LLaVADataset")

    def llava_max_length(self, length: int, line: int) -> int:
        """xtuner's LLaVA counts an image as one token in max_length (its configs subtract the image's patches:
        `int(2048 - (336 / 14)**2)`); tuneforge's data.max_length counts all the tokens an image becomes."""
        tokens = self.image_tokens
        if tokens is None:
            self.note(
                f"max_length {length} (line {line}): xtuner counts an image as one token there, tuneforge counts "
                "all the tokens an image becomes: add the tower's image tokens less one to data.max_length"
            )
            return length
        self.note(
            f"max_length {length} (line {line}) -> data.max_length {length + tokens - 1}: xtuner counts an image as "
            f"one token there, tuneforge counts the {tokens} tokens an image of this tower becomes"
        )
        return length + tokens - 1

    def map_image_processor(self, dataset: Call) -> None:
        """The image processor xtuner builds from the tower's checkpoint: tuneforge uses the tower's own too."""
        processor = self.take(dataset, "image_processor")
        if processor is None:
            return
        tower = self.section("model").get("vision", {}).get("tower_path")
        path = processor.get("pretrained_model_name_or_path") if isinstance(processor, Call) else None
        if isinstance(path, str) and local(path) == tower:
            for key in ("pretrained_model_name_or_path", "trust_remote_code"):
                self.take(processor, key)
            self.leftovers(processor, "image_processor")
            return
        why = "tuneforge processes images with the vision tower's own processor (model.vision.tower_path)"
        self.unmapped(self.line(dataset, "image_processor"), f"image_processor = {shown(processor)}", why)

    def map_internvl_dataset(self, dataset: Call) -> None:
        """InternVL_V1_5_Dataset: LLaVA-style records (image + conversations) in json or jsonl files, each with
        its image folder, rendered in InternVL's own chat format with a fixed system prompt."""
        source = self.take(dataset, "model_path")
        if source is not None and source != self.internvl_path:
            why = "tuneforge reads the tokenizer and the image settings from model.path's processor"
            self.unmapped(self.line(dataset, "model_path"), f"InternVL_V1_5_Dataset.model_path = {shown(source)}", why)
        self.map_internvl_files(dataset)
        folders = self.take(dataset, "image_folders")
        line = self.line(dataset, "image_folders")
        if isinstance(folders, (list, tuple)) and len(set(map(str, folders))) > 1:
            self.unmapped(line, f"InternVL_V1_5_Dataset.image_folders = {shown(folders)}", ONE_IMAGE_ROOT)
        else:
            folder = folders[0] if isinstance(folders, (list, tuple)) and folders else folders
            self.map_image_root(folder, line, "InternVL_V1_5_Dataset.image_folders")
        repeats = self.take(dataset, "repeat_times")
        if repeats is not None and any(r != 1 for r in (repeats if isinstance(repeats, (list, tuple)) else [repeats])):
            why = "xtuner repeats (or subsamples) each file's records; repeat them in the data to match"
            self.unmapped(self.line(dataset, "repeat_times"), f"repeat_times = {shown(repeats)}", why)
        self.put("format", "sharegpt", dataset.line)
        self.map_internvl_template(dataset)
        if (length := self.number(dataset, "max_length", "InternVL_V1_5_Dataset")) is not None:
            self.put("max_length", int(length), self.line(dataset, "max_length"))
            self.note(TRUNCATION_DIFFERENCE)
        self.leftovers(dataset, "InternVL_V1_5_Dataset")

    def map_internvl_files(self, dataset: Call) -> None:
        files = self.take(dataset, "data_paths")
        line = self.line(dataset, "data_paths")
        what = "InternVL_V1_5_Dataset.data_paths"
        paths = self.strings(files, line, what, "set data.train_files")
        for path in paths or []:
            if not path.endswith((".json", ".jsonl")):
                self.unmapped(line, f"{what}: {path!r}", "not a .json or .jsonl file, the only ones xtuner reads")
            elif path.endswith(".json") and self.json_object(path):
                why = (
                    "a JSON object, not a list of records: InternVL's meta file (annotation, root, repeat_time per "
                    "dataset) is not xtuner's data format; list its annotation files in data.train_files and set "
                    "data.image_root"
                )
                self.unmapped(line, f"{what}: {path!r}", why)
            else:
                self.section("data").setdefault("train_files", []).append(str(Path(path).expanduser().resolve()))

    @staticmethod
    def json_object(path: str) -> bool:
        """Whether a local .json file holds an object (a meta file) rather than an array of records; its first
        character says, and nothing more is read."""
        try:
            with open(Path(path).expanduser(), encoding="utf-8-sig") as handle:
                return handle.read(4096).lstrip()[:1] == "{"
        except (OSError, UnicodeDecodeError):
            return False

    def map_internvl_template(self, dataset: Call) -> None:
        template = self.take(dataset, "template")
        line = self.line(dataset, "template")
        name = template.name if isinstance(template, Symbol) else None
        system = INTERNVL_SYSTEMS.get(name or "")
        if system is not None:
            self.section("data")["system"] = system
        self.note(
            "InternVL_V1_5_Dataset writes InternVL's own chat format whatever `template` says, with a fixed system "
            "prompt: data.template is left unset, so the processor's chat template (InternVL's) renders the chats"
            + (
                f", and data.system is that prompt, read from template {name} (line {line})"
                if system is not None
                else f"; set data.system to the prompt xtuner gives ({shown(template)} names no known one)"
            )
        )
