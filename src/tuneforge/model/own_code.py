"""Model folders that need their own Python code: a `config.json` whose `model_type` transformers does not
implement, with `auto_map` naming the folder's files that would implement it. That code runs only when
`model.trust_remote_code` says so; without it, transformers raises a multi-line ValueError from deep in its
loader. Read as plain JSON, and transformers is imported only to settle a model type its files do not name, so
the launcher can check this before it starts the workers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def own_code_problem(path: str | None, trust_remote_code: bool) -> str | None:
    """One line naming the folder and why it cannot load here, with the fix; None where transformers loads it
    (or the folder is not local: a hub id, a missing file, which other checks report)."""
    config = _local_config(path) if path is not None else None
    model_type = config.get("model_type") if config is not None else None
    if not isinstance(model_type, str):  # transformers then guesses it from the folder's name: left to it
        return None
    auto_map = config.get("auto_map")
    has_code = isinstance(auto_map, dict) and bool(auto_map)
    if (has_code and trust_remote_code) or _implemented(model_type):
        return None
    if not has_code:
        return (
            f"model.path: {path} has model_type {model_type!r}, which this transformers does not implement, and no "
            "code of its own (no auto_map in its config.json); use a model transformers implements"
        )
    return (
        f"model.path: {path} needs its own Python code ({', '.join(code_files(auto_map))}, named by auto_map in "
        f"its config.json): transformers does not implement model_type {model_type!r}, and tuneforge runs a model "
        "folder's code only when told to; use a model transformers implements, or set "
        "model.trust_remote_code=true if you trust that code"
    )


def code_files(auto_map: dict) -> list[str]:
    """The Python files `auto_map` names: "modeling_x.MyModel" (or "repo--modeling_x.MyModel", or a list of
    such for tokenizers) is class MyModel of modeling_x.py."""
    references = [r for value in auto_map.values() for r in (value if isinstance(value, list) else [value])]
    modules = {r.split("--")[-1].rsplit(".", 1)[0] for r in references if isinstance(r, str) and "." in r}
    return sorted(f"{module}.py" for module in modules)


def _local_config(path: str) -> dict | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _implemented(model_type: str) -> bool:
    """Whether transformers implements `model_type`. Most model types are the name of their folder in
    transformers' source, found without importing it (seconds, with torch); the others are looked up."""
    spec = importlib.util.find_spec("transformers")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(root) / "models" / model_type.replace("-", "_")).is_dir():
            return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES
