"""Import every config of an xtuner config gallery and count how each one ends.

Each config must either import (perhaps with NOT MAPPED settings, listed in its YAML) or be refused with one
UserError line saying which setting cannot be carried over and why; anything else is a crash, printed with
its traceback, and makes the exit status 1. Nothing is downloaded: give an unpacked `xtuner/configs`
directory, e.g. from the wheel (`pip download xtuner==0.1.23 --no-deps`, then unzip it).

The vision-language configs (xtuner's LLaVAModel and InternVL_V1_5 models: configs/llava and configs/internvl)
are counted again on a line of their own, with the settings they most often leave unmapped.

System prompts (`SYSTEM_TEMPLATE.x`) resolve only where xtuner's package can be found; to use an unpacked
wheel without installing it, put its directory on PYTHONPATH (it is located, never imported):

    PYTHONPATH=/tmp/xt/full .venv/bin/python benchmarks/xtuner_gallery.py /tmp/xt/full/xtuner/configs -v
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import traceback
from pathlib import Path

from tuneforge.errors import UserError
from tuneforge.xtuner.evaluate import Call, read_config
from tuneforge.xtuner.map_vision import VISION_MODELS
from tuneforge.xtuner.mapper_base import type_name
from tuneforge.xtuner.mapping import import_config, to_yaml


def reason(message: str, path: Path) -> str:
    """The refusal without its location, cut to the setting it names (`model type DPO`), for counting."""
    text = re.sub(rf"^{re.escape(str(path))}(:\d+)?: ", "", message)
    return text.split(" cannot be carried over")[0].split(";")[0]


def setting(what: str) -> str:
    """An unmapped setting without its value (`pad_image_to_square`), for counting."""
    return re.split(r" = |: ", what, maxsplit=1)[0]


def vision_model(path: Path) -> bool:
    """Whether the config trains one of xtuner's vision-language models (read, never run)."""
    try:
        model = read_config(path).values.get("model")
    except UserError:
        return False
    return isinstance(model, Call) and type_name(model.type) in VISION_MODELS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", type=Path, help="an unpacked xtuner/configs directory")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per refused or partly mapped config")
    parser.add_argument("--xtuner-version", default="0.1.23", help="the gallery's xtuner version, for the summary")
    args = parser.parse_args()
    if not args.configs.is_dir():
        parser.error(f"{args.configs}: not a directory")

    configs = sorted(p for p in args.configs.rglob("*.py") if p.name != "__init__.py")
    imported, partial, crashed = 0, 0, 0
    refused: collections.Counter[str] = collections.Counter()
    vision = {"configs": 0, "imported": 0, "partial": 0}
    vision_refused: collections.Counter[str] = collections.Counter()
    vision_unmapped: collections.Counter[str] = collections.Counter()
    for path in configs:
        name = path.relative_to(args.configs)
        is_vision = vision_model(path)
        vision["configs"] += is_vision
        try:
            result = import_config(path)
            to_yaml(result, path)
        except UserError as exc:
            refused[reason(str(exc), path)] += 1
            if is_vision:
                vision_refused[reason(str(exc), path)] += 1
            if args.verbose:
                print(f"refused   {str(exc).replace(str(path), str(name))}")
            continue
        except Exception:  # the bug this benchmark exists to catch: show it whole
            crashed += 1
            print(f"CRASHED   {name}", file=sys.stderr)
            traceback.print_exc()
            continue
        imported += 1
        vision["imported"] += is_vision
        if result.unmapped:
            partial += 1
            vision["partial"] += is_vision
            if is_vision:  # each setting once per config, however many datasets of it repeat it
                vision_unmapped.update({setting(what) for _, what, _ in result.unmapped})
            if args.verbose:
                what = "; ".join(f"line {line}: {what}" for line, what, _ in result.unmapped)
                print(f"unmapped  {name}: {len(result.unmapped)} setting(s): {what}")

    counts = ", ".join(f"{why} {n}" for why, n in refused.most_common())
    summary = (
        f"xtuner {args.xtuner_version} gallery: {len(configs)} configs, {imported} imported "
        f"({partial} with settings left unmapped), {sum(refused.values())} refused: {counts or 'none'}"
    )
    print(summary + (f"; {crashed} CRASHED" if crashed else ""))
    if vision["configs"]:
        counts = ", ".join(f"{why} {n}" for why, n in vision_refused.most_common())
        settings = ", ".join(f"{what} {n}" for what, n in vision_unmapped.most_common())
        print(
            f"vision-language ({', '.join(VISION_MODELS)}): {vision['configs']} configs, {vision['imported']} "
            f"imported ({vision['partial']} with settings left unmapped), {sum(vision_refused.values())} refused: "
            f"{counts or 'none'}; configs leaving each setting unmapped: {settings or 'none'}"
        )
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
