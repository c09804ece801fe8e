"""Using a trained model: load a checkpoint of any layout (or a Hugging Face folder) into one process,
sample from it (`generation.py`, behind `python -m torchtrain.generate`) and score its answers against
references with reward functions (`scoring.py`, behind `python -m torchtrain.score`)."""
