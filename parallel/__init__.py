"""How a video DiT is split and run. Each folder is a layer (tests/unit/test_architecture.py's LAYERS,
docs/architecture.md); the modules beside this file are the commands, on top of them all."""
