"""The trainer's parts: the batch plan, checkpoints with full trainer state, DDP/FSDP, exports and tracking."""
