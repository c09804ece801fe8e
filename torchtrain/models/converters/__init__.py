"""Model converters: what replaces a model's modules before it is parallelised, as the resolved layout decides --
LoRA adapters on frozen weights (`lora.py`) and float8 matmuls (`float8.py`). They change the model, not how it is
distributed; the applier (`distributed/parallelize.py`) runs them in its order."""
