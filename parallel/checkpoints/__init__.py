"""Checkpoints: DeepSpeed's published atomically with every file's CRC-32, damage detected, resume;
the layout-free copy each rank writes of its slices, read back at another layout."""
