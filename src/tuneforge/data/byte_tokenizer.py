"""A byte-level tokenizer built locally: one token per byte, no merges, no download.

Every UTF-8 text round-trips exactly, which makes it the right tokenizer for fresh demo and
test models. It is a regular ``PreTrainedTokenizerFast`` and saves like any other.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS.values())}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    model = models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk"])
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        unk_token=SPECIAL_TOKENS["unk"],
    )
