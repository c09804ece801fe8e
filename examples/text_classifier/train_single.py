"""Train the text classifier on one device: a plain PyTorch loop.

    python examples/text_classifier/train_single.py --steps 20
"""

import argparse

import torch
import torch.nn.functional as F
from classifier import TextClassifier, make_dataset
from torch.utils.data import DataLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    steps = parser.parse_args().steps
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TextClassifier().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(make_dataset(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))

    step = 0
    while step < steps:
        for tokens, labels in loader:
            loss = F.cross_entropy(model(tokens.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"step {step} loss {loss.item():.6f}")
            step += 1
            if step == steps:
                break


if __name__ == "__main__":
    main()
