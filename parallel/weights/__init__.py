"""Released weights: reading and writing the layouts other libraries publish (diffusers)."""
