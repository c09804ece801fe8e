"""Arguments of a Hugging Face transformers causal language model: the folder it is described by, and
what the trainer reads off it (sizes, parameter and FLOP counts, the vocabulary check). A composite
vision-language config of a type in `IMAGE_TEXT` is read too (its text model's sizes, its vision tower's
patch geometry for the image data: `vision_language.py`); other composite types are refused naming why.

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
    if is_composite(config):
        check_composite(config, path)
        return config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False) or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"[model.hf_path] model type {config.model_type!r} ({path}) is not a decoder-only causal "
                          f"language model of transformers (AutoModelForCausalLM has no class for it)")
    return config


def is_composite(config) -> bool:
    """Whether `config` wraps a text model in a composite (vision-language) config."""
    return config.get_text_config() is not config


IMAGE_TEXT = ("qwen3_5", "qwen3_5_moe", "qwen2_5_vl", "qwen2_vl")
"""Composite model types trained (`vision_language.py`): the Qwen-VL image layout -- packed patches with their
`image_grid_thw`, placeholders replaced by the vision tower's merged features, multimodal RoPE positions."""
NOT_TRAINED = {
    "gemma3": "its vision tower takes whole fixed-size pictures (not packed patches) and its image tokens attend "
              "to each other both ways, which torchtrain's attention does not do",
    "qwen3_vl": "it adds its vision tower's intermediate features to its first decoder layers (deepstack), which "
                "torchtrain's forward does not do",
}
NOT_TRAINED["qwen3_vl_moe"] = NOT_TRAINED["qwen3_vl"]


def check_composite(config, path: str) -> None:
    """ConfigError (one line naming what is missing) unless `config` is a composite type the backend trains."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    kind = config.model_type
    if kind in IMAGE_TEXT and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return
    why = NOT_TRAINED.get(kind, f"torchtrain trains the Qwen-VL image layout (packed patches, image_grid_thw, "
                                f"multimodal RoPE) of {', '.join(IMAGE_TEXT)} only")
    raise ConfigError(f"[model.hf_path] composite model type {kind!r} ({path}) is not trained: {why}; give the folder "
                      f"of its text model to train the decoder alone (its text_config, model_type "
                      f"{config.get_text_config().model_type!r})")


def hf_class(config) -> type:
    """The transformers class the backend builds for `config`: its causal LM, or its image-text-to-text class."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    return (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if is_composite(config) else MODEL_FOR_CAUSAL_LM_MAPPING)[type(config)]


def with_layers(config, n_layers: int):
    """A copy of `config` with its first `n_layers` decoder layers (per-layer lists cut to match; a composite
    config's text model)."""
    out = copy.deepcopy(config)
    text = out.get_text_config()
    total = text.num_hidden_layers
    if n_layers and n_layers != total:
        for key, value in vars(text).items():
            if isinstance(value, (list, tuple)) and len(value) == total and key != "architectures":
                setattr(text, key, type(value)(value[:n_layers]))
        text.num_hidden_layers = n_layers
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

    import_transformers()
    config = with_layers(_read_config(path, mtime), n_layers)
    with torch.device("meta"):
        model = hf_class(config)(config)
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
        total = self.text_config().num_hidden_layers
        if self.n_layers > total:
            raise ConfigError(f"[model.n_layers] {self.n_layers} exceeds the {total} layers of {self.hf_path}")
        self.n_layers = self.n_layers or total

    def config_mtime(self) -> float:
        """When the folder's config.json last changed (cache keys)."""
        return os.path.getmtime(os.path.join(self.hf_path, "config.json"))

    def full_config(self):
        """The folder's config as transformers reads it (shared: do not modify)."""
        return _read_config(os.path.abspath(self.hf_path), self.config_mtime())

    def text_config(self):
        """The folder's text model config: the config itself, or a composite config's text_config."""
        return self.full_config().get_text_config()

    @property
    def composite(self) -> bool:
        """A vision-language config (`vision_language.py`)."""
        return is_composite(self.full_config())

    @property
    def layers_prefix(self) -> str:
        """The decoder layers' parameter-name prefix."""
        return "model.language_model.layers." if self.composite else "model.layers."

    @property
    def config(self):
        """A copy of the config with the layers this model builds."""
        return with_layers(self.full_config(), self.n_layers)

    # The transformers config's sizes under the model contract's names.
    model_type = property(lambda self: self.full_config().model_type)
    dim = property(lambda self: self.text_config().hidden_size)
    vocab_size = property(lambda self: self.text_config().vocab_size)
    n_heads = property(lambda self: self.text_config().num_attention_heads)

    @property
    def kv_heads(self) -> int:
        c = self.text_config()
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.text_config()
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.full_config(), "tie_word_embeddings", False))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        c = self.text_config()
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            value = getattr(c, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return 0

    @property
    def num_experts_per_tok(self) -> int:
        return int(getattr(self.text_config(), "num_experts_per_tok", 0) or 0)

    def describe(self) -> str:
        """How the start-up line and the planner name the model."""
        return f"{self.model_type} from {self.hf_path}"

    def image_geometry(self) -> tuple[int, int, int] | None:
        """(patch size, temporal patch size, merge size) of a vision-language config's vision tower; None otherwise."""
        if not self.composite:
            return None
        v = self.full_config().vision_config
        return v.patch_size, v.temporal_patch_size, v.spatial_merge_size

    def bind_image_tokens(self, image_pad: int, vision_start: int, vision_end: int) -> None:
        """The tokenizer's image tokens must be the config's (the model's forward and its exports use these)."""
        c = self.full_config()
        ours = {"image_token_id": image_pad, "vision_start_token_id": vision_start, "vision_end_token_id": vision_end}
        for key, value in ours.items():
            if getattr(c, key, value) != value:
                raise ConfigError(f"[model.hf_assets_path] the tokenizer's image tokens are not the model's: its "
                                  f"{key.removesuffix('_id')} is id {value}, {self.hf_path}/config.json says "
                                  f"{getattr(c, key)}; use the model's own tokenizer")

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
