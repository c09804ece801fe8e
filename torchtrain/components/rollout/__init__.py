"""What reinforcement learning on the model's own samples needs besides the train step: sampling completions
(`sampling.py`) and scoring them with reward functions (`rewards.py`)."""
