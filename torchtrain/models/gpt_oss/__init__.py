"""gpt-oss: model, published shapes, parallel plan, registered as "gpt_oss"."""

from torchtrain.models.common.spec import register_decoder
from torchtrain.models.gpt_oss.args import GptOssArgs
from torchtrain.models.gpt_oss.model import GptOssTransformer
from torchtrain.models.gpt_oss.parallelize import apply_tp, validate_gpt_oss
from torchtrain.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

# Published shapes (OpenAI's config.json files): width 2880, 64 query heads and 8 key/value heads of 64,
# 128-token sliding windows on alternate layers, experts of width 2880, top-4, vocabulary 201,088, YaRN
# (factor 32 over a 4,096-token original context, RoPE base 150,000), RMSNorm eps 1e-5.
#   20b:  24 layers,  32 experts: 20.9B parameters, 3.6B active per token (input embedding excluded)
#   120b: 36 layers, 128 experts: 116.8B parameters, 5.1B active per token
# `debugmodel` is CPU-sized (a 16-token window so that sliding layers mask something at short lengths).
_SHAPE = dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088, hidden_dim=2880, norm_eps=1e-5,
              rope_theta=150000.0, num_experts_per_tok=4, moe_intermediate_size=2880)
GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    "debugmodel": GptOssArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048,
                             hidden_dim=256, norm_eps=1e-5, rope_theta=150000.0, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=256, sliding_window=16),
    "20b": GptOssArgs(n_layers=24, num_experts=32, **_SHAPE),
    "120b": GptOssArgs(n_layers=36, num_experts=128, **_SHAPE),
}

register_decoder("gpt_oss", GptOssTransformer, GptOssArgs, GPT_OSS_FLAVORS, tp_plan=apply_tp,
                 validate=validate_gpt_oss, state_dict_adapter=GptOssStateDictAdapter)

__all__ = ["GPT_OSS_FLAVORS", "GptOssArgs", "GptOssStateDictAdapter", "GptOssTransformer"]
