"""Train the text classifier on any number of processes: train_single.py with torchtrain.accelerate.

    torchrun --nproc_per_node=2 examples/text_classifier/train_distributed.py --steps 20
    python -m torchtrain.launcher --nproc_per_node=2 examples/text_classifier/train_distributed.py

The layout is FSDP over every process unless $TORCHTRAIN_PARALLELISM names a TOML file with a
[parallelism] table (or pass Accelerator(parallelism={...})); the model's own `_tp_plan` is used for
tensor parallelism. `diff train_single.py train_distributed.py` shows what changed.
"""

import argparse

import torch
import torch.nn.functional as F
from classifier import TextClassifier, make_dataset
from torch.utils.data import DataLoader

from torchtrain.accelerate import Accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    steps = parser.parse_args().steps
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TextClassifier().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(make_dataset(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = 0
    while step < steps:
        for tokens, labels in loader:
            loss = F.cross_entropy(model(tokens.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            accelerator.print(f"step {step} loss {accelerator.gather_for_metrics(loss).mean().item():.6f}")
            step += 1
            if step == steps:
                break


if __name__ == "__main__":
    main()
