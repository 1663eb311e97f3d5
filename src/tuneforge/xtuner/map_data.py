"""xtuner's `train_dataloader`: datasets, their sources, map functions, templates and lengths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneforge.xtuner.evaluate import Call
from tuneforge.xtuner.mapper_base import MapperBase, shown, type_name

MAP_FUNCTIONS = {"openai_map_fn": "openai", "alpaca_map_fn": "alpaca"}
ALPACA_DIFFERENCES = (
    "dataset_map_fn alpaca_map_fn -> format alpaca, which differs from it in two ways: records whose output is "
    "<nooutput> are trained (xtuner skips them; remove them from the data to match), and an empty input adds no "
    "newline after the instruction (xtuner's prompt always ends with one)"
)
"""What xtuner 0.1.23's `alpaca_map_fn` does that tuneforge's Alpaca reader does not, said on import."""
OPENAI_DIFFERENCES = (
    "dataset_map_fn openai_map_fn -> format openai, which differs from it on unusual records only: one that starts "
    "with an assistant message is dropped and counted (xtuner skips the message), and consecutive user messages "
    "are joined with a newline (xtuner joins them with nothing)"
)
TRUNCATION_DIFFERENCE = (
    "max_length: xtuner cuts a longer sample at max_length tokens, mid-turn; tuneforge drops it and counts it "
    "(data.truncation: drop), or with data.truncation: truncate keeps its whole leading turns that fit"
)
"""xtuner dataset map functions and the tuneforge format that reads the same records."""
PAIR_MAP_FUNCTIONS = ("orpo_dpo_mix_40k_map_fn",)
"""xtuner map functions for preference rows that tuneforge's pair reader reads as they are: `chosen` and
`rejected` whole conversations sharing their prompt (the reader takes the shared first messages as it)."""
LOCAL_LOADERS = ("json", "parquet")
"""`load_dataset(path=...)` builders whose `data_files` tuneforge reads itself."""
SHAREGPT_LIKE = ("sharegpt", "conversations")


class DataMapping(MapperBase):
    def map_data(self, dataloader: Any) -> None:
        train = self.section("train")
        if not isinstance(dataloader, Call):
            self.unmapped(0, "train_dataloader", "not found; set data.train_files yourself")
            return
        if (batch := self.number(dataloader, "batch_size", "train_dataloader")) is not None:
            train["micro_batch_size"] = batch
        dataset = self.take(dataloader, "dataset")
        for key in ("num_workers", "sampler", "collate_fn"):
            self.skip(dataloader, key)
        self.leftovers(dataloader, "train_dataloader")
        if isinstance(dataset, Call) and type_name(dataset) == "ConcatDataset":
            parts = self.take(dataset, "datasets")
            self.leftovers(dataset, "ConcatDataset")
            for part in parts if isinstance(parts, list) else [parts]:
                self.map_dataset(part, self.line(dataset, "datasets"))
        else:
            self.map_dataset(dataset, self.line(dataloader, "dataset"))
        if files := self.section("data").get("train_files"):
            self.result.notes.append(f"data_files resolved from the current directory: {files}")

    def put(self, key: str, value: Any, line: int) -> None:
        """Set data.`key`; parts of a ConcatDataset that disagree on it are listed, as tuneforge takes one."""
        data = self.section("data")
        if key in data and data[key] != value:
            self.unmapped(line, f"ConcatDataset parts with data.{key} {data[key]!r} and {value!r}", "one per config")
        else:
            data[key] = value

    def map_dataset(self, dataset: Any, line: int) -> None:
        if not isinstance(dataset, Call):
            self.unmapped(line, f"train_dataset = {shown(dataset)}", "not a dataset dict; set data.train_files")
            return
        kind = type_name(dataset)
        if kind == "build_preference_dataset":
            self.map_pairs(dataset)
            return
        if kind != "process_hf_dataset":
            if self.map_other_dataset(dataset, kind):
                return
            self.unmapped(
                dataset.line,
                f"train_dataset type {kind}",
                "an xtuner dataset builder with no tuneforge equivalent; convert the data to OpenAI messages, "
                "ShareGPT or Alpaca JSONL and set data.train_files",
            )
            return
        self.map_source(self.take(dataset, "dataset"), self.line(dataset, "dataset"))
        map_fn = self.take(dataset, "dataset_map_fn")
        if map_fn is not None:
            name = type_name(map_fn)
            if name in MAP_FUNCTIONS:
                self.put("format", MAP_FUNCTIONS[name], self.line(dataset, "dataset_map_fn"))
                if name == "alpaca_map_fn":
                    self.result.notes.append(ALPACA_DIFFERENCES)
                else:
                    self.result.notes.append(OPENAI_DIFFERENCES)
            elif any(key in name for key in SHAREGPT_LIKE):
                self.put("format", "sharegpt", self.line(dataset, "dataset_map_fn"))
            else:
                fix = "a custom map function; convert the data to OpenAI messages, ShareGPT or Alpaca records"
                if name == "alpaca_zh_map_fn":  # Alpaca records under other key names
                    fix = "reads instruction_zh/input_zh/output_zh: rename them to instruction/input/output (alpaca)"
                self.unmapped(self.line(dataset, "dataset_map_fn"), f"dataset_map_fn = {name}", fix)
        self.map_template_fn(dataset)
        if (length := self.number(dataset, "max_length", "train_dataset")) is not None:
            self.put("max_length", int(length), self.line(dataset, "max_length"))
            self.result.notes.append(TRUNCATION_DIFFERENCE)
        if (pack := self.take(dataset, "pack_to_max_length")) is not None:
            self.put("packing", bool(pack), self.line(dataset, "pack_to_max_length"))
        self.take(dataset, "tokenizer")
        self.leftovers(dataset, "train_dataset")

    def map_other_dataset(self, dataset: Call, kind: str) -> bool:
        """A dataset type other than `process_hf_dataset` mapped by another part (vision-language datasets);
        False: none maps it."""
        return False

    def map_template_fn(self, dataset: Call) -> None:
        """`template_map_fn=dict(type=template_map_fn_factory, template=...)` -> data.template."""
        template_fn = self.take(dataset, "template_map_fn")
        if isinstance(template_fn, Call):
            template = self.take(template_fn, "template")
            if template is not None:
                resolved = self.template(template, self.line(template_fn, "template"))
                if resolved is not None:
                    self.put("template", resolved, self.line(template_fn, "template"))
            self.leftovers(template_fn, "template_map_fn")
        elif template_fn is not None:
            self.unmapped(self.line(dataset, "template_map_fn"), f"template_map_fn = {shown(template_fn)}", "not read")

    def map_pairs(self, dataset: Call) -> None:
        """xtuner's preference dataset: its source, map function and lengths. Pairs are packed with their answers
        in one row whatever xtuner's varlen settings, so those need nothing."""
        self.map_source(self.take(dataset, "dataset"), self.line(dataset, "dataset"))
        map_fn = self.take(dataset, "dataset_map_fn")
        if map_fn is not None and type_name(map_fn) not in PAIR_MAP_FUNCTIONS:
            self.unmapped(
                self.line(dataset, "dataset_map_fn"),
                f"dataset_map_fn = {type_name(map_fn)}",
                "a custom map function; write the pairs as prompt/chosen/rejected rows (messages) and set "
                "data.train_files",
            )
        self.put("template", "tokenizer", dataset.line)
        self.result.notes.append(
            "build_preference_dataset renders pairs with the tokenizer's chat template -> data.template: tokenizer"
        )
        if self.take(dataset, "is_reward") and (token := self.take(dataset, "reward_token_id")) is not None:
            self.result.notes.append(
                f"reward_token_id = {token} (line {self.line(dataset, 'is_reward')}): xtuner appends that token to "
                "every conversation and scores there; tuneforge scores at the conversation's last token that is not "
                "the pad token, where AutoModelForSequenceClassification reads it, so no token is added"
            )
        if (length := self.number(dataset, "max_length", "train_dataset")) is not None:
            self.put("max_length", int(length), self.line(dataset, "max_length"))
        if self.take(dataset, "use_varlen_attn"):
            self.put("packing", True, self.line(dataset, "use_varlen_attn"))
        for key in ("tokenizer", "is_dpo", "reward_token_id", "num_proc", "max_packed_length", "shuffle_before_pack"):
            self.take(dataset, key)
        self.leftovers(dataset, "train_dataset")

    def map_source(self, source: Any, line: int) -> None:
        """`dataset=dict(type=load_dataset, path='json', data_files=...)`: the local files, resolved."""
        if not isinstance(source, Call) or type_name(source) != "load_dataset":
            fix = "not datasets' load_dataset; save the data as JSONL and set data.train_files"
            self.unmapped(line, f"dataset = {shown(source)}", fix)
            return
        path, files = self.take(source, "path"), self.take(source, "data_files")
        if path not in LOCAL_LOADERS or files is None:
            self.unmapped(
                self.line(source, "path"),
                f"load_dataset path = {shown(path)}",
                "a Hugging Face Hub dataset or a loader tuneforge does not read; tuneforge reads local JSONL, "
                "JSON, parquet or save_to_disk directories: save it so and set data.train_files",
            )
        else:
            fields = files.fields if isinstance(files, Call) and files.type is None else files
            if isinstance(fields, dict) and "train" in fields:
                files = fields["train"]  # process_hf_dataset trains on the `train` split only
            fix = "set data.train_files"
            if (paths := self.strings(files, self.line(source, "data_files"), "data_files", fix)) is not None:
                # xtuner resolves data paths from the directory it is started in.
                resolved = [str(Path(f).expanduser().resolve()) for f in paths]
                self.section("data").setdefault("train_files", []).extend(resolved)
        self.leftovers(source, "dataset")
