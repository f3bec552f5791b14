"""What more than one family builds from (docs/architecture.md): HunyuanVideo's dual/single-stream blocks and
head (`mmdit.py`) and its token refiner (`refiner.py`), which HunyuanVideo 1.5 reuses; their released tensor
names (`released.py`); VAE latent formats and text encoders (`pipeline.py`). A family folder imports this package
and models/' top-level modules, never another family's folder (tests/unit/test_architecture.py)."""
