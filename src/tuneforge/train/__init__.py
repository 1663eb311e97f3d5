"""The training loop and what runs around it: optimizer, schedule, progress, checkpoints."""
