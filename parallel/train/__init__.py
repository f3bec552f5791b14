"""Training: DeepSpeed engine set-up, optimizer and EMA, the loop, data feeding, checkpoints, validation
and the media it writes."""
