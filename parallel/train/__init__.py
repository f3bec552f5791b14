"""Training: DeepSpeed engine set-up, optimizer and EMA, the loop, data feeding, the resume's continuity, the
watchdog and the step probe; a batch sampled from a checkpoint. Checkpoints and validation: parallel/checkpoints/,
parallel/validation/."""
