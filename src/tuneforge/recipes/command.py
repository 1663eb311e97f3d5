"""`tuneforge recipes`: list the ready configs, copy one to edit, or show one with the doctor's verdict for
the GPU it was sized for (or another)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tuneforge.recipes import all_recipes, copy_recipe, find_recipe


def add_parser(commands: argparse._SubParsersAction, gpu_choices: list[str]) -> None:
    recipes = commands.add_parser(
        "recipes",
        help="list ready configs for the models people fine-tune, copy one to edit, or show one with the doctor",
        epilog="examples:\n  tuneforge recipes\n  tuneforge recipes copy llama-3-8b-lora-1gpu my.yaml\n"
        "  tuneforge recipes show qwen3-30b-a3b-lora-fsdp-8gpu --gpu a100-80gb",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = recipes.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", help="the recipes, with the GPUs each is sized for (the default)")
    copy = actions.add_parser("copy", help="write a recipe to a file to edit (never over an existing one)")
    copy.add_argument("name", help="the recipe's name, as `tuneforge recipes` lists it")
    copy.add_argument("dest", nargs="?", type=Path, help="file or directory (default: NAME.yaml here)")
    show = actions.add_parser("show", help="print a recipe and the doctor's verdict on its model's real shapes")
    show.add_argument("name", help="the recipe's name, as `tuneforge recipes` lists it")
    show.add_argument("--gpu", choices=gpu_choices, help="size it for this GPU instead of the one it names")


def run(args: argparse.Namespace) -> int:
    if args.action in (None, "list"):
        recipes = all_recipes()
        width = max(len(recipe.name) for recipe in recipes)
        for recipe in recipes:
            print(f"{recipe.name:<{width}}  {recipe.gpus} x {recipe.gpu:<9}  {recipe.title}")
        print("\n`tuneforge recipes copy NAME` writes one to edit; `tuneforge recipes show NAME` checks it")
        return 0
    recipe = find_recipe(args.name)
    if args.action == "copy":
        target = copy_recipe(recipe, args.dest)
        print(f"wrote {target}: put your data where its data.train_files say, then")
        print(f"  {recipe.launch.replace(recipe.path.name, str(target))}")
        return 0
    from tuneforge.doctor_report import print_doctor

    print(recipe.path.read_text(encoding="utf-8"))
    gpu = args.gpu or recipe.gpu
    print(f"doctor, for {recipe.gpus} x {gpu} on the published shapes of its model ({recipe.shapes.name}):")
    return print_doctor(recipe.path, [], recipe.gpus, 1, gpu, recipe.shapes)
