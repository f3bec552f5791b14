"""The model build: a family's stages for a layout (one module or pipeline stages), selective
recomputation, LoRA and its checks."""
