"""Data: document sources -> tokenized, packed windows -> a stateful, data-parallel-aware loader."""

from torchtrain.components.data.dataset import PackedDataset
from torchtrain.components.data.loader import build_dataloader
from torchtrain.components.data.sources import (DocumentSource, build_source, check_dataset_name, dataset_names,
                                                register_dataset)

__all__ = ["DocumentSource", "PackedDataset", "build_dataloader", "build_source", "check_dataset_name", "dataset_names",
           "register_dataset"]
