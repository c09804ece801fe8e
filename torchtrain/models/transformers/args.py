"""Arguments of a Hugging Face transformers causal language model: the folder it is described by, and
what the trainer reads off it (sizes, parameter and FLOP counts, the vocabulary check).

The folder's `config.json` is read by transformers' own `AutoConfig` (never code from the folder:
remote code is refused), so the model type must be one the installed transformers knows. Parameter
counts come from the model built on the meta device (no memory); FLOPs per token follow the convention
of the native families (`models/common/decoder.py::DecoderFlops`): 6 x the parameters of the matmuls a token
takes part in (routed experts counted top-k of E) + 12 x layers x heads x head_dim x seq_len.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from torchtrain.config.fields import ConfigError
from torchtrain.models.base import BaseModelArgs
from torchtrain.models.common.decoder import DecoderFlops

if TYPE_CHECKING:
    from torchtrain.data.tokenizer import Tokenizer

EXTRA = "pip install 'torchtrain[transformers]'"


def import_transformers():
    """The installed transformers package (ConfigError naming the extra when it is missing)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"[model.name] \"transformers\" needs the transformers package: {EXTRA}") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ConfigError(f"[model.name] \"transformers\" needs transformers >= 5 (installed: "
                          f"{transformers.__version__}): {EXTRA}")
    return transformers


@functools.lru_cache(maxsize=8)
def _read_config(path: str, mtime: float):
    transformers = import_transformers()
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if raw.get("auto_map"):
        raise ConfigError(f"[model.hf_path] {path}/config.json asks for code from the model folder (auto_map); "
                          f"torchtrain never runs code it did not ship: only model types the installed transformers "
                          f"knows are built")
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"[model.hf_path] {path}/config.json is not a config the installed transformers "
                          f"{transformers.__version__} can read: {str(e).splitlines()[0]}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False) or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"[model.hf_path] model type {config.model_type!r} ({path}) is not a decoder-only causal "
                          f"language model of transformers (AutoModelForCausalLM has no class for it)")
    if config.get_text_config() is not config:
        raise ConfigError(f"[model.hf_path] model type {config.model_type!r} ({path}) wraps a text model in a "
                          f"composite (e.g. multimodal) config; give the folder of its text model (its text_config, "
                          f"e.g. model_type {config.get_text_config().model_type!r})")
    return config


def with_layers(config, n_layers: int):
    """A copy of `config` with its first `n_layers` decoder layers (per-layer lists cut to match)."""
    out = copy.deepcopy(config)
    total = config.num_hidden_layers
    if n_layers and n_layers != total:
        for key, value in vars(config).items():
            if isinstance(value, (list, tuple)) and len(value) == total and key != "architectures":
                setattr(out, key, type(value)(value[:n_layers]))
        out.num_hidden_layers = n_layers
    return out


def small_config(args: "TransformersArgs", layers: int = 1):
    """A copy of the model's config with `layers` decoder layers and tiny widths, for checks that run the model's
    own code on a small copy (its semantics do not depend on the sizes)."""
    config = with_layers(args.full_config(), layers)
    for key, value in (("hidden_size", 16), ("intermediate_size", 8), ("moe_intermediate_size", 8),
                       ("head_dim", 4), ("num_attention_heads", 4), ("num_key_value_heads", 4)):
        if hasattr(config, key):
            setattr(config, key, value)
    return config


@functools.lru_cache(maxsize=8)
def _parameter_shapes(path: str, mtime: float, n_layers: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter of the model built on the meta device (tied ones once)."""
    import torch

    transformers = import_transformers()
    config = with_layers(_read_config(path, mtime), n_layers)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


@dataclass
class TransformersArgs(DecoderFlops, BaseModelArgs):
    """A transformers causal LM described by a local folder (docs/transformers.md)."""

    hf_path: str = ""
    """Local folder of a Hugging Face causal language model: its `config.json` (read by the installed
    transformers; code from the folder is never run), and optionally `*.safetensors` weights (the
    initial load) and a `tokenizer.json` (the job's tokenizer unless model.hf_assets_path names another)."""

    n_layers: int = 0
    """Decoder layers to build: 0 (set to the config's `num_hidden_layers`) builds them all; fewer builds the
    first ones."""

    attention_mask: Literal["causal", "block_causal"] = "causal"
    """`causal`: every token attends to all earlier tokens of its window. `block_causal`: only to earlier
    tokens of its own document, with positions restarting at each document (needs a model whose attention
    goes through transformers' attention-function registry)."""

    # ------------------------------------------------------------------ the config
    def validate(self) -> None:
        if not self.hf_path:
            raise ConfigError("[model.hf_path] is required for model.name = \"transformers\": a local folder with a "
                              "Hugging Face config.json")
        if not os.path.isfile(os.path.join(self.hf_path, "config.json")):
            raise ConfigError(f"[model.hf_path] {self.hf_path!r} holds no config.json (a local Hugging Face model "
                              f"folder is expected)")
        if self.n_layers < 0:
            raise ConfigError(f"[model.n_layers] must be >= 0 (0: the config's), got {self.n_layers}")
        total = self.full_config().num_hidden_layers
        if self.n_layers > total:
            raise ConfigError(f"[model.n_layers] {self.n_layers} exceeds the {total} layers of {self.hf_path}")
        self.n_layers = self.n_layers or total

    def config_mtime(self) -> float:
        """When the folder's config.json last changed (cache keys)."""
        return os.path.getmtime(os.path.join(self.hf_path, "config.json"))

    def full_config(self):
        """The folder's config as transformers reads it (shared: do not modify)."""
        return _read_config(os.path.abspath(self.hf_path), self.config_mtime())

    @property
    def config(self):
        """A copy of the config with the layers this model builds."""
        return with_layers(self.full_config(), self.n_layers)

    @property
    def model_type(self) -> str:
        return self.full_config().model_type

    @property
    def dim(self) -> int:
        return self.full_config().hidden_size

    @property
    def vocab_size(self) -> int:
        return self.full_config().vocab_size

    @property
    def n_heads(self) -> int:
        return self.full_config().num_attention_heads

    @property
    def kv_heads(self) -> int:
        c = self.full_config()
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.full_config()
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.full_config(), "tie_word_embeddings", False))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        c = self.full_config()
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            value = getattr(c, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    @property
    def num_experts_per_tok(self) -> int:
        return int(getattr(self.full_config(), "num_experts_per_tok", 0) or 0)

    def describe(self) -> str:
        """How the start-up line and the planner name the model."""
        return f"{self.model_type} from {self.hf_path}"

    # ------------------------------------------------------------------ the job
    def update_from_job(self, seq_len: int, tokenizer: "Tokenizer") -> None:
        if tokenizer.vocab_size > self.vocab_size:
            raise ConfigError(
                f"[model.hf_assets_path] the tokenizer's ids (vocabulary of {tokenizer.vocab_size}) do not fit the "
                f"model's vocabulary ({self.vocab_size}, {self.hf_path}/config.json): use the model's own tokenizer "
                f"(a tokenizer.json in model.hf_path, with model.hf_assets_path unset) or one with at most "
                f"{self.vocab_size} ids")

    # ------------------------------------------------------------------ counts
    def parameter_shapes(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return _parameter_shapes(os.path.abspath(self.hf_path), self.config_mtime(), self.n_layers)

    def _counts(self) -> dict[str, int]:
        import math

        total = experts = embedding = 0
        for name, shape in self.parameter_shapes():
            n = math.prod(shape)
            total += n
            if name.endswith("embed_tokens.weight") or name.endswith("wte.weight"):
                embedding += n
            elif ".experts." in name and len(shape) == 3 and self.num_experts and shape[0] == self.num_experts:
                experts += n
        return {"total": total, "experts": experts, "embedding": embedding}

    def num_params(self, exclude_embedding: bool = False) -> int:
        c = self._counts()
        return c["total"] - (c["embedding"] if exclude_embedding else 0)

    def num_active_params(self, exclude_embedding: bool = False) -> int:
        """Parameters one token's forward uses (routed experts: top-k of them)."""
        c = self._counts()
        inactive = 0
        if c["experts"]:
            inactive = c["experts"] - c["experts"] * self.num_experts_per_tok // self.num_experts
        return self.num_params(exclude_embedding) - inactive
