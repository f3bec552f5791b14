"""One process's training batch for a config's model, shared by tests/unit/test_offload.py and test_block_swap.py
(a test module imports no other test module)."""
from __future__ import annotations

import torch


def random_batch(cfg, size: int = 2) -> tuple[tuple, torch.Tensor]:
    """((latents, timesteps, text states), target) of `size` samples from generator seed 1."""
    from models.geometry import latent_shape

    m, g = cfg.model, torch.Generator().manual_seed(1)
    inputs = (torch.randn(size, m.transformer_in_channels, *latent_shape(m, cfg.data), generator=g),
              torch.randint(0, 1000, (size,), generator=g), torch.randn(size, m.max_text_len, m.text_embed_dim, generator=g))
    return inputs, torch.randn(size, m.in_channels, *latent_shape(m, cfg.data), generator=g)
