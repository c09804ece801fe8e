"""Qwen3 (dense): model, published shapes, parallel plan, registered as "qwen3"."""

from torchtrain.models.common.spec import register_decoder
from torchtrain.models.qwen3.args import Qwen3Args
from torchtrain.models.qwen3.model import Transformer
from torchtrain.models.qwen3.parallelize import apply_tp, validate_qwen3
from torchtrain.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

# Published shapes (Qwen's HF config.json files): head_dim 128, RoPE base 1e6, RMSNorm eps 1e-6,
# vocabulary 151,936; the three small models tie their embeddings. `debugmodel` is CPU-sized.
QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, vocab_size=2048,
                            hidden_dim=768),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
}

register_decoder("qwen3", Transformer, Qwen3Args, QWEN3_FLAVORS, tp_plan=apply_tp, validate=validate_qwen3,
                 state_dict_adapter=Qwen3StateDictAdapter)

__all__ = ["QWEN3_FLAVORS", "Qwen3Args", "Qwen3StateDictAdapter", "Transformer"]
