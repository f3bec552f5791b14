"""How a video DiT is split and run: topology, tensor-parallel layers, checks, configs."""
