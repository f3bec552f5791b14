"""The video diffusion transformers, written with parallel/'s layers and free of process-group code."""
