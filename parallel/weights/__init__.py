"""Weights as full tensors: reading and writing the layouts other libraries publish (diffusers, Open-Sora),
gathered from any layout, the EMA's too."""
