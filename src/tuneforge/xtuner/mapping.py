"""An xtuner 0.1.x config, read by `evaluate`, mapped onto a tuneforge config.

Every field of every dict the mapping visits is either used, known to need nothing in tuneforge, or listed
as unmapped with its line and the reason. xtuner counts `save_steps`, `evaluation_freq` and logger
intervals in iterations (one micro-batch per rank); tuneforge counts optimizer steps, one per
`accumulative_counts` iterations: those are converted and the conversion is printed. Values a config
reaches through xtuner's own modules (`SYSTEM_TEMPLATE.x`, `PROMPT_TEMPLATE.x`) are read from xtuner's
installed templates.py with the same safe reader (never imported); without xtuner they are listed as unmapped.
Nothing but plain data reaches the YAML, and nothing but a UserError leaves `import_config`.
"""

from __future__ import annotations

from pathlib import Path

from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import Call, read_config
from tuneforge.xtuner.map_model import PREFERENCE_MODELS
from tuneforge.xtuner.map_training import TrainingMapping
from tuneforge.xtuner.map_vision import VISION_MODELS, VisionMapping
from tuneforge.xtuner.mapper_base import Imported, plain_value, type_name

KNOWN_MODELS = ("SupervisedFinetune", *PREFERENCE_MODELS, *VISION_MODELS)


class Mapper(VisionMapping, TrainingMapping):
    """The whole mapping: the model, the data, then the training settings, each part in its own module (the
    vision-language models' and datasets' in `map_vision`, over the text ones)."""

    def run(self, deepspeed: str | None, nproc_per_node: int | None) -> Imported:
        values = self.module.values
        model = values.get("model")
        if not isinstance(model, Call):
            unread = [(line, why) for line, why in self.module.skipped if why.startswith("`model = ...`")]
            if unread:
                line, why = unread[-1]
                raise UserError(f"{self.path}:{line}: {why}; write that field as a literal value")
            raise UserError(f"{self.path}: no `model = dict(...)` found; is this an xtuner config?")
        if values.get("framework") == "huggingface":  # xtuner's other config kind: HF Trainer arguments
            raise UserError(
                f"{self.path}:{self.module.lines['framework']}: framework = 'huggingface' cannot be carried over: "
                "a config for xtuner's Hugging Face Trainer path; tuneforge maps its mmengine configs"
            )
        kind = type_name(model.type)
        if kind not in KNOWN_MODELS:
            why = f"tuneforge maps xtuner's {', '.join(KNOWN_MODELS)}"
            raise UserError(f"{self.path}:{model.line}: model type {kind} cannot be carried over: {why}")
        if kind in PREFERENCE_MODELS:
            self.map_preference(model, PREFERENCE_MODELS[kind])
        if kind in VISION_MODELS:
            self.map_vision_model(model, kind, values.get("tokenizer"))
        else:
            self.map_model(model, values.get("tokenizer"))
            self.map_whole_vlm(model)
        self.stage = "train_dataloader"
        self.map_data(values.get("train_dataloader"))
        self.stage = "optim_wrapper"
        accumulation = self.map_optimizer(values.get("optim_wrapper"))
        self.stage = "param_scheduler"
        self.map_schedule(values.get("param_scheduler"), values.get("train_cfg"), accumulation)
        self.stage = "custom_hooks / default_hooks"
        self.map_hooks(values.get("custom_hooks") or [], values.get("default_hooks"), accumulation)
        self.stage = "runtime settings"
        self.map_runtime(deepspeed, nproc_per_node)
        return self.result


def import_config(path: Path, deepspeed: str | None = None, nproc_per_node: int | None = None) -> Imported:
    """The tuneforge equivalent of an xtuner config; a UserError, never another exception, for one it cannot read."""
    module = read_config(path)
    mapper = Mapper(module, path)
    try:
        result = mapper.run(deepspeed, nproc_per_node)
    except UserError:
        raise
    except Exception as exc:  # a value of a shape no rule expects: refuse the config, naming where, not crash
        raise UserError(
            f"{path}: {mapper.stage} cannot be carried over: a value of an unexpected shape "
            f"({type(exc).__name__}: {exc}); set it in the YAML yourself"
        ) from None
    for line, why in module.skipped:
        result.unmapped.append((line, "statement", why))
    _, config = plain_value(result.config, "config", 0, mapper.origins, result.unmapped)
    result.config = {key: value for key, value in config.items() if value}
    result.unmapped.sort(key=lambda entry: entry[0])
    return result


def _comment(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")  # one report line stays one comment line


def to_yaml(result: Imported, source: Path, out: Path | None = None) -> str:
    """The native config, headed by how to launch it, what was converted and what could not be mapped.

    Values YAML cannot hold as plain data never reach the dumper: they become NOT MAPPED lines here too.
    """
    import yaml

    unmapped = list(result.unmapped)
    _, config = plain_value(result.config, "config", 0, {}, unmapped)
    header = [f"# tuneforge config imported from {source}"]
    if result.launch:
        launch = result.launch.replace("OUT.yaml", str(out)) if out else result.launch
        header.append(f"# launch: {launch}" + ("" if out else "  (OUT.yaml: this file)"))
    header += [f"# conversion: {note}" for note in result.notes]
    header += [f"# NOT MAPPED{f' (line {line})' if line else ''}: {what}: {why}" for line, what, why in unmapped]
    body = yaml.safe_dump(config, allow_unicode=True, sort_keys=False, width=110)
    return "\n".join(_comment(line) for line in header) + "\n" + body
