"""Model and tokenizer loading or fresh construction."""
