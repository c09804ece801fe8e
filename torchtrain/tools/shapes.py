"""A small, learnable image dataset drawn on the spot: one coloured shape per picture, questions about it.

    python -m torchtrain.tools.shapes OUT [--train 512] [--test 64] [--seed 0] [--tars 2]

writes, under OUT:

* ``images/NNNNN.png``: a red, green, blue or yellow circle, square or triangle nearly filling a white
  picture, centred, the picture's own size drawn between 32 and 64 pixels a side;
* ``train.jsonl`` / ``test.jsonl``: image chat records (`docs/vision_language.md`), one user turn holding the
  image and a question -- "What shape is this?", "What colour is the shape?" or "Describe the picture." --
  and the assistant's answer ("circle", "red", "red circle");
* ``tars/shard-K.tar`` (with ``--tars K``): the training pictures as WebDataset image-text pairs
  (``KEY.png`` + ``KEY.txt`` caption "a red circle");
* ``tokenizer/`` (the command line): a byte-level tokenizer with Qwen's chat and image tokens and a
  Qwen-style chat template (`write_tokenizer`), so a tiny model trains on the set without a download.

The answers depend on the picture alone, so a model answers held-out pictures right only by seeing them:
the vision-language tests train on it, and the README's fine-tuning example uses it. Needs Pillow
(``pip install 'torchtrain[vision]'``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import tarfile

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {"shape": "What shape is this?", "colour": "What colour is the shape?",
             "both": "Describe the picture."}


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(folder: str) -> dict[str, int]:
    """A byte-level tokenizer.json (256 byte ids, then SPECIAL: Qwen's chat and image tokens) and a
    tokenizer_config.json with a Qwen-style chat template (`CHAT_TEMPLATE`: list contents, an image as
    <|vision_start|><|image_pad|><|vision_end|>); returns the special tokens' ids. Needs `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({name: 256 + i for i, name in enumerate(SPECIAL)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}, f)
    return {name: 256 + i for i, name in enumerate(SPECIAL)}


def toy_parser(module: str, doc: str, folder: str, count: str, count_help: str) -> argparse.ArgumentParser:
    """The toy-data commands' arguments: the folder written, how many items (`--<count>`) and the seed."""
    ap = argparse.ArgumentParser(prog=f"python -m torchtrain.tools.{module}", description=doc.split("\n")[0])
    ap.add_argument("folder", help=f"where {folder} and tokenizer/ are written")
    ap.add_argument(f"--{count}", type=int, default=4000, help=f"{count_help} (default 4000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the numbers drawn (default 0)")
    return ap


def wrote(paths: dict[str, str], folder: str) -> int:
    """What a toy-data command says when done (its exit status, 0)."""
    print("wrote " + ", ".join(paths.values()) + f" and {os.path.join(folder, 'tokenizer')}")
    return 0


def prompt_toy_main(argv: list[str] | None, module: str, doc: str, files: str, write, share: tuple[str, float, str]
                    ) -> int:
    """A GRPO toy's command: `write(folder, prompts, seed, share)` with the toy's one share option (`share`: its flag,
    default and help)."""
    flag, default, help_ = share
    ap = toy_parser(module, doc, files, "prompts", "conversations and prompts each")
    ap.add_argument(flag, type=float, default=default, help=help_)
    ns = vars(ap.parse_args(argv))
    return wrote(write(ns["folder"], ns["prompts"], ns["seed"], ns[flag[2:].replace("-", "_")]), ns["folder"])


def draw(shape: str, colour: str, rng: random.Random, sizes: tuple[int, int] = (32, 64)):
    """One picture (a Pillow image) of `shape` in `colour`, each side drawn from `sizes` (pixels)."""
    from PIL import Image, ImageDraw

    w, h = rng.randint(*sizes), rng.randint(*sizes)
    image = Image.new("RGB", (w, h), (255, 255, 255))
    side = min(w, h) - rng.randint(2, 6)
    x, y = (w - side) // 2, (h - side) // 2
    pen = ImageDraw.Draw(image)
    box = (x, y, x + side - 1, y + side - 1)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=COLOURS[colour])
    return image


def answer(kind: str, shape: str, colour: str) -> str:
    return {"shape": shape, "colour": colour, "both": f"{colour} {shape}"}[kind]


def write(out: str, train: int = 512, test: int = 64, seed: int = 0, tars: int = 0,
          sizes: tuple[int, int] = (32, 64)) -> None:
    """The dataset of the module doc under `out` (picture sides drawn from `sizes`)."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    pictures = []
    for i in range(train + test):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        name = f"images/{i:05d}.png"
        draw(shape, colour, rng, sizes).save(os.path.join(out, name))
        pictures.append((name, shape, colour))
    for split, chosen in (("train", pictures[:train]), ("test", pictures[train:])):
        with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
            for name, shape, colour in chosen:
                kind = rng.choice(list(QUESTIONS))
                content = [{"type": "image", "path": name}, {"type": "text", "text": QUESTIONS[kind]}]
                f.write(json.dumps({"messages": [{"role": "user", "content": content},
                                                 {"role": "assistant", "content": answer(kind, shape, colour)}]})
                        + "\n")
    if tars:
        os.makedirs(os.path.join(out, "tars"), exist_ok=True)
        for k in range(tars):
            with tarfile.open(os.path.join(out, "tars", f"shard-{k}.tar"), "w") as tar:
                for i, (name, shape, colour) in enumerate(pictures[:train]):
                    if i % tars != k:
                        continue
                    with open(os.path.join(out, name), "rb") as f:
                        _add(tar, f"{i:05d}.png", f.read())
                    _add(tar, f"{i:05d}.txt", f"a {colour} {shape}".encode())


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torchtrain.tools.shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write")
    ap.add_argument("--train", type=int, default=512, help="training pictures (default 512)")
    ap.add_argument("--test", type=int, default=64, help="held-out pictures (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tars", type=int, default=0, help="also write the training pictures as K tar shards")
    ap.add_argument("--size", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                    help="picture sides drawn between MIN and MAX pixels (default 32 64)")
    ns = ap.parse_args(argv)
    try:
        import PIL  # noqa: F401
    except ImportError:
        print("torchtrain.tools.shapes: error: drawing pictures needs Pillow: pip install 'torchtrain[vision]'",
              file=sys.stderr)
        return 2
    write(ns.out, ns.train, ns.test, ns.seed, ns.tars, tuple(ns.size))
    write_tokenizer(os.path.join(ns.out, "tokenizer"))
    print(f"wrote {ns.train} training and {ns.test} held-out pictures under {ns.out}, and a byte-level tokenizer "
          f"with Qwen's image tokens and a chat template under {ns.out}/tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
