"""Generation: sample text from a trained model -- a DCP checkpoint of any layout, or a Hugging Face
folder -- with the job's model and tokenizer, in one process on CPU or GPU.

    python -m torchtrain.generate --checkpoint outputs/debug_model/checkpoint --prompt "def " \\
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [--device cpu]

See `torchtrain/inference/generation.py` and the README.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from torchtrain.config.fields import ConfigError
from torchtrain.inference.generation import Sampling, generate, load, room_for


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m torchtrain.generate", allow_abbrev=False,
                                 description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="DCP checkpoint (dump, checkpoint or step-N folder) or an "
                                                        "HF folder")
    ap.add_argument("--config", help="the job's TOML file (default: the job_config.toml saved above the checkpoint)")
    ap.add_argument("--prompt", default="", help="text to continue (default: none, start from BOS)")
    ap.add_argument("--chat", action="store_true",
                    help="treat --prompt as a user turn: render it with the chat template (the tokenizer's own, "
                         "or the built-in one of the byte tokenizer) and its generation prompt, print the answer")
    ap.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image before the prompt, for a vision-language model (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                    help="parameter dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    return ap


def _check(ns: argparse.Namespace) -> None:
    if ns.max_new_tokens < 1 or ns.num_samples < 1:
        raise ConfigError("--max-new-tokens and --num-samples must be >= 1")
    if ns.temperature < 0 or ns.top_k < 0 or not 0 < ns.top_p <= 1:
        raise ConfigError("--temperature must be >= 0, --top-k >= 0 and --top-p in (0, 1]")
    if ns.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")


def main(argv: list[str] | None = None) -> int:
    from torchtrain.utils.progress import Progress

    ns, overrides = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        bad = [a for a in overrides if a.startswith("--") and "." not in a.split("=", 1)[0]]
        if bad:
            raise ConfigError(f"unknown flag {bad[0]} (see --help); job overrides look like --section.key value")
        _check(ns)
        device = torch.device("cuda" if ns.device == "cuda" or (ns.device == "auto" and torch.cuda.is_available())
                              else "cpu")
        dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}[ns.dtype]
        t0 = time.perf_counter()
        job = load(ns.checkpoint, ns.config, overrides, device, dtype)
        tok = job.tokenizer
        images = None
        if ns.image:
            prompt, images = job.prompt_with_images(ns.image, ns.prompt, ns.chat)
        elif ns.chat:
            from torchtrain.data.chat.records import Conversation
            from torchtrain.data.chat.template import chat_renderer

            prompt = chat_renderer(tok).generation_prompt(Conversation((("user", ns.prompt),), "--prompt"))
        else:
            prompt = tok.encode(ns.prompt, bos=True, eos=False)
        if not prompt:
            raise ConfigError("--prompt is empty and the tokenizer has no BOS token to start from; give a prompt")
        print(f"loaded {job.source} on {device} ({str(dtype).removeprefix('torch.')}) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        max_seq_len = job.args.max_seq_len or None
        new_tokens = ns.max_new_tokens
        if images is not None and new_tokens > room_for(len(prompt), max_seq_len):
            new_tokens = room_for(len(prompt), max_seq_len)
            print(f"note: the prompt with its images is {len(prompt)} tokens of the model's {max_seq_len}: "
                  f"generating at most {new_tokens} new tokens (--max-new-tokens {ns.max_new_tokens})", file=sys.stderr)
        with Progress("generate", total=new_tokens * ns.num_samples, unit="tokens") as bar:
            outs = generate(job.model, prompt, new_tokens, Sampling(ns.temperature, ns.top_k, ns.top_p),
                            ns.num_samples, ns.seed, None if ns.ignore_eos else tok.eos_id, tok.vocab_size,
                            max_seq_len, bar, images)
    except ConfigError as e:
        print(f"torchtrain.generate: error: {e}", file=sys.stderr)
        return 2
    for i, ids in enumerate(outs):
        if ns.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(tok.decode(ids) if ns.chat or ns.image else ns.prompt + tok.decode(ids))
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
