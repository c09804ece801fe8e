"""The training dataloader: torchdata's StatefulDataLoader over a PackedDataset."""

from __future__ import annotations

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtrain.components.data.dataset import PackedDataset
from torchtrain.components.data.sources import DocumentSource
from torchtrain.components.tokenizer import Tokenizer

# torchdata 0.11 calls a deprecated torch API on every loader start; the warning is not actionable here.
warnings.filterwarnings("ignore", message=".*set_vital.*is deprecated")


def build_dataloader(source: DocumentSource, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                     dp_rank: int, dp_degree: int, seed: int, shuffle: bool = True,
                     infinite: bool = True) -> StatefulDataLoader:
    """Batches {"input_ids", "labels"}, each (local_batch_size, seq_len), for data-parallel rank dp_rank.

    Loading runs in the training process (num_workers = 0): packing is cheap next to a training step,
    and the loader's state is then exactly the dataset's stream position.
    """
    ds = PackedDataset(source, tokenizer, seq_len, dp_rank=dp_rank, dp_degree=dp_degree, seed=seed,
                       shuffle=shuffle, infinite=infinite)
    return StatefulDataLoader(ds, batch_size=local_batch_size, num_workers=0, drop_last=True)
