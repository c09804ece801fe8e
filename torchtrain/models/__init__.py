"""Models. Importing this package registers the built-in ones (see `registry`)."""

from torchtrain.models import llama3  # noqa: F401  (registers "llama3")
from torchtrain.models import qwen3  # noqa: F401,E402  (registers "qwen3")
from torchtrain.models import qwen3_moe  # noqa: F401,E402  (registers "qwen3_moe")
from torchtrain.models import deepseek_v3  # noqa: F401,E402  (registers "deepseek_v3")
