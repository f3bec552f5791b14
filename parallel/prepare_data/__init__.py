"""Data preparation: videos and captions -> VAE latents, text embeddings and a manifest."""
