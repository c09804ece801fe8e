"""A small transformer text classifier in plain PyTorch, and a synthetic sentiment dataset.

Nothing here knows about distributed training: `train_single.py` trains it on one device,
`train_distributed.py` is the same script with torchtrain.accelerate's Accelerator (docs/accelerate.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

POSITIVE = ["good", "great", "lovely", "superb", "fine", "happy"]
NEGATIVE = ["bad", "awful", "poor", "sad", "dull", "broken"]
FILLER = ["the", "movie", "was", "really", "plot", "and", "a", "very", "cast", "it"]

# How the model's layers split over tensor-parallel ranks (module-name patterns -> styles): attention
# heads and the feed-forward's hidden units are split; o and fc2 sum the partial outputs.
TP_PLAN = {
    "blocks.*.attn.[qkv]": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.fc1": "colwise",
    "blocks.*.mlp.fc2": "rowwise",
}


def make_dataset(n: int = 512, seq_len: int = 48, seed: int = 0) -> TensorDataset:
    """Sentences of filler words with a few sentiment words, as bytes; label 1 when positive words win."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(n, seq_len, dtype=torch.long)
    labels = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        words, score = [], 0
        for _ in range(8):
            pick = int(torch.randint(0, 4, (), generator=g))
            if pick == 0:
                words.append(POSITIVE[int(torch.randint(0, len(POSITIVE), (), generator=g))])
                score += 1
            elif pick == 1:
                words.append(NEGATIVE[int(torch.randint(0, len(NEGATIVE), (), generator=g))])
                score -= 1
            else:
                words.append(FILLER[int(torch.randint(0, len(FILLER), (), generator=g))])
        data = list(" ".join(words).encode())[:seq_len]
        tokens[i, :len(data)] = torch.tensor(data)
        labels[i] = int(score > 0)
    return TensorDataset(tokens, labels)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TextClassifier(nn.Module):
    _tp_plan = TP_PLAN  # (read by torchtrain.accelerate when the layout has tensor parallelism)

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, seq_len: int = 48,
                 classes: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))
