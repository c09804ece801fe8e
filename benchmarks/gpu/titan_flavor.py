"""Imported by torchtitan (`experimental.custom_import = "titan_flavor"`) in the GPU kit's part (d): adds
the kit's ~1B Llama 3 shape to torchtitan's llama3 flavors as "torchtrain_1B" (torchtitan 0.2.2 has no
1B flavor), and holds torchtitan to the kit's measurement protocol (`titan_window.py`). The same shape as torchtrain's llama3 "1B" with an untied output layer: dim 2048, 16 layers,
32 heads, 8 KV heads, FFN multiplier 1.5 (hidden 8192), vocabulary 128,256, RoPE theta 500,000."""

import titan_window
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

llama3_args["torchtrain_1B"] = TransformerModelArgs(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
    rope_theta=500000, rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0))

titan_window.install_from_env()
