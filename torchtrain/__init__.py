"""torchtrain: a PyTorch-native trainer for large language models."""

import sys

__version__ = "0.1.0"

if sys.argv[:1] == ["-m"]:  # `python -m torchtrain.<command>` is being started (Python sets argv[0] after)
    from torchtrain.utils.environment import check_command_environment

    check_command_environment()
