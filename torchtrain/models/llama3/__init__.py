"""Llama 3 (and 3.1 / 3.2 shapes): model, presets, parallel plan, registered as "llama3"."""

from torchtrain.models.common.spec import register_decoder
from torchtrain.models.llama3.args import Llama3Args
from torchtrain.models.llama3.model import Transformer
from torchtrain.models.llama3.parallelize import apply_tp, validate_llama
from torchtrain.models.llama3.state_dict_adapter import Llama3StateDictAdapter

# Published shapes (Meta's params.json / HF config.json). `debugmodel` is torchtitan's CPU-sized
# debug shape; the RoPE table length follows training.seq_len unless model.max_seq_len is set.
LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, vocab_size=2048),
    "1B": Llama3Args(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                     multiple_of=256, rope_scaling_factor=32.0, tie_word_embeddings=True),
    "3B": Llama3Args(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                     multiple_of=256, rope_scaling_factor=32.0, tie_word_embeddings=True),
    "8B": Llama3Args(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=1024),
    "70B": Llama3Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                      multiple_of=4096),
    "405B": Llama3Args(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                       multiple_of=4096),
}

register_decoder("llama3", Transformer, Llama3Args, LLAMA3_FLAVORS, tp_plan=apply_tp, validate=validate_llama,
                 state_dict_adapter=Llama3StateDictAdapter)

__all__ = ["LLAMA3_FLAVORS", "Llama3Args", "Llama3StateDictAdapter", "Transformer"]
