"""Validation: layout-independent validation loss and sample videos, and the media it writes (GIF/MP4,
loss plots, index.html)."""
