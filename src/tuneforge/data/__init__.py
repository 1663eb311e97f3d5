"""Chat data: conversations, templates, tokenization with loss masks, batching."""
