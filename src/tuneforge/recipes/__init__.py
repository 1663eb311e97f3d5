"""Ready configs for the models people fine-tune, shipped with the package beside the published shapes of
their models (`models/NAME.config.json`), so that the doctor sizes each one for its GPU without a download.

A recipe is a YAML config whose first comment lines say what it is:

    # recipe: Llama-3-8B, LoRA r=16, one 80 GB GPU
    # gpu: h100 x 1
    # shapes: llama-3-8b
    # launch: tuneforge train llama-3-8b-lora.yaml

`gpu` names the GPU it was sized for (a key of `estimate.hardware.ACCELERATORS`) and how many per node,
`shapes` the file in `models/` that holds its model's config.json.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from tuneforge.errors import UserError

RECIPES = Path(__file__).resolve().parent
MODEL_SHAPES = RECIPES / "models"
FIELDS = ("recipe", "gpu", "shapes", "launch")


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    title: str
    gpu: str
    gpus: int
    shapes: Path
    launch: str


def read_recipe(path: Path) -> Recipe:
    """The recipe's header fields; a recipe file without them is a packaging mistake, said with its name."""
    fields: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line.lstrip("# ").partition(":")
        if key in FIELDS and value.strip():
            fields[key] = value.strip()
    missing = [key for key in FIELDS if key not in fields]
    if missing:
        raise ValueError(f"recipe {path}: no {', '.join(missing)} line in its header")
    gpu, _, count = fields["gpu"].partition(" x ")
    return Recipe(
        name=path.stem,
        path=path,
        title=fields["recipe"],
        gpu=gpu.strip(),
        gpus=int(count or 1),
        shapes=MODEL_SHAPES / f"{fields['shapes']}.config.json",
        launch=fields["launch"],
    )


def all_recipes() -> list[Recipe]:
    return [read_recipe(path) for path in sorted(RECIPES.glob("*.yaml"))]


def find_recipe(name: str) -> Recipe:
    recipes = {recipe.name: recipe for recipe in all_recipes()}
    if name.removesuffix(".yaml") in recipes:
        return recipes[name.removesuffix(".yaml")]
    close = difflib.get_close_matches(name, list(recipes), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"no recipe {name!r}{hint} (`tuneforge recipes` lists them)")


def copy_recipe(recipe: Recipe, destination: Path | None) -> Path:
    """The recipe written to `destination` (a file, or a directory to put NAME.yaml in; default the current
    directory). An existing file is never overwritten."""
    target = destination or Path.cwd()
    if target.is_dir():
        target = target / recipe.path.name
    if target.is_symlink():  # dangling or not: writing would land in the link's target, somewhere the user did not name
        raise UserError(f"{target} is a symbolic link; name another file, or remove the link first")
    if target.exists():
        raise UserError(f"{target} exists; name another file, or remove it first")
    if not target.parent.is_dir():
        raise UserError(f"{target.parent} is not a directory; create it first")
    try:
        write_new(target, recipe.path.read_bytes())
    except FileExistsError:  # created (a file or a link) between the checks above and the write
        raise UserError(f"{target} exists; name another file, or remove it first") from None
    except OSError as exc:  # an unwritable directory, a full disk
        raise UserError(f"{target}: cannot write the recipe ({exc.strerror or exc}); choose another place") from None
    return target


def write_new(target: Path, content: bytes) -> None:
    """`content` in a file created at `target`: exclusive creation fails on anything already there, a symbolic
    link included (even a dangling one), so nothing is ever written through a link or over a file."""
    with target.open("xb") as file:
        file.write(content)
