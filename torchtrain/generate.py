"""Generation: sample text from a trained model -- a DCP checkpoint of any layout, or a Hugging Face
folder -- with the job's model and tokenizer, in one process on CPU or GPU.

    python -m torchtrain.generate --checkpoint outputs/debug_model/checkpoint --prompt "def " \\
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [--device cpu]

See `torchtrain/tools/generate.py` and the README.
"""

import sys

from torchtrain.tools.generate import main

if __name__ == "__main__":
    sys.exit(main())
