"""Models. Importing this package registers the built-in ones (see `registry`)."""

from torchtrain.models import (
    deepseek_v3,  # noqa: F401,E402  (registers "deepseek_v3")
    gpt_oss,  # noqa: F401,E402  (registers "gpt_oss")
    llama3,  # noqa: F401  (registers "llama3")
    qwen3,  # noqa: F401,E402  (registers "qwen3")
    qwen3_5,  # noqa: F401,E402  (registers "qwen3_5", dense and MoE flavors)
    qwen3_moe,  # noqa: F401,E402  (registers "qwen3_moe")
    transformers,  # noqa: F401,E402  (registers "transformers": any causal LM of the transformers package)
)
