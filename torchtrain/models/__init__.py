"""Models. Importing this package registers the built-in ones (see `registry`)."""

from torchtrain.models import llama3  # noqa: F401  (registers "llama3")
