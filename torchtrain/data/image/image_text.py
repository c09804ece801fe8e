"""The `image_text` dataset: image-text pairs in WebDataset tar shards, as samples packed like chat.

`training.dataset_path` is a folder of ``*.tar`` shards (searched recursively; or one ``.tar`` file, or a
glob), or `training.datasets` a mixture of such. A shard holds samples as members named ``KEY.EXT``: the
key is the member's path up to the first dot of its file name, ``KEY.jpg`` / ``.jpeg`` / ``.png`` /
``.webp`` the image and ``KEY.txt`` its caption (UTF-8); members with other extensions are ignored.

* **Index.** Every shard's headers are scanned once, when the run starts (`tarfile`): each image's data
  offset and size (`images.TarMember`) and each caption. A sample is then read by offset, never by a scan,
  so global sample g is a pure function of g, and everything else comes from the chat packing
  (`chat/packing.py`): per-rank sharding, the seeded per-epoch shuffle, packing several samples per row with
  positions restarting at each, exact resume from the loader's global sample counter.
* **Tokens.** A sample is ``<BOS>`` (when the tokenizer has one), the image (`<|vision_start|>`, its
  `<|image_pad|>` tokens, `<|vision_end|>`), the caption's tokens and EOS; the loss trains on the caption and
  EOS. A caption longer than the rest of seq_len follows `training.chat_overlong` (cut after its image, or
  dropped); an image whose tokens alone exceed seq_len is an error naming the shard and key (raise
  training.seq_len or lower images.max_pixels).
* **Bad input.** A key with an image but no caption or the reverse, two images, an empty or non-UTF-8
  caption, an image Pillow cannot read (its header and `verify`), a member cut off by the end of the file,
  and a shard whose headers break off (the rest of that shard) are errors naming the shard and key before
  training; with `training.bad_images = "skip"` they are left out, counted and logged once per source.
"""

from __future__ import annotations

import glob
import os
import tarfile
from dataclasses import dataclass

from torchtrain.config.fields import ConfigError
from torchtrain.config.training import DatasetEntry
from torchtrain.data.chat.packing import ChatSource, build_chat_source
from torchtrain.data.image.image_chat import Skipped, fit
from torchtrain.data.image.pixels import ImageSpec, TarMember, image_size
from torchtrain.data.tokenizer import Tokenizer
from torchtrain.utils.logging import logger

IMAGE_TEXT = "image_text"
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp")
CAPTION_SUFFIX = "txt"


@dataclass(frozen=True)
class Pair:
    """One sample of a shard: its image and caption."""

    where: str
    """shard:key, for messages."""
    image: TarMember
    caption: str


def tar_files(path: str, key: str) -> list[str]:
    """The shards `path` names: a .tar file, a folder (searched recursively) or a glob, sorted."""
    if any(ch in path for ch in "*?["):
        found = sorted(glob.glob(path, recursive=True))
    elif os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*.tar"), recursive=True))
    elif os.path.isfile(path):
        found = [path]
    else:
        raise ConfigError(f"[{key}] {path}: no such file, folder or glob match")
    files = [f for f in found if os.path.isfile(f) and f.endswith(".tar")]
    if not files:
        raise ConfigError(f"[{key}] {path} holds no .tar shards of image-text pairs (KEY.jpg/.png/.webp + KEY.txt)")
    return files


def _split(name: str) -> tuple[str, str]:
    """(key, extension) of a member name, WebDataset's way: the key ends at the file name's first dot."""
    folder, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return os.path.join(folder, stem) if folder else stem, ext.lower()


def _damaged_tail(path: str, offset: int) -> bool:
    """Whether bytes other than the end-of-archive zeros follow `offset` (headers that broke off)."""
    with open(path, "rb") as f:
        f.seek(offset)
        while block := f.read(1 << 16):
            if block.count(0) != len(block):
                return True
    return False


def index_shard(path: str) -> tuple[list[Pair], list[str]]:
    """The pairs of one shard in member order, and its problems (module doc), each naming shard:key."""
    size = os.path.getsize(path)
    members: dict[str, dict[str, tarfile.TarInfo]] = {}
    captions: dict[str, bytes] = {}
    problems: list[str] = []
    try:
        with tarfile.open(path, "r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, ext = _split(m.name)
                if ext not in IMAGE_SUFFIXES and ext != CAPTION_SUFFIX:
                    continue
                if m.offset_data + m.size > size:
                    problems.append(f"{path}:{key}: {m.name} is cut off by the end of the file")
                    continue
                members.setdefault(key, {})[ext] = m
                if ext == CAPTION_SUFFIX:
                    captions[key] = tar.extractfile(m).read()
            end = tar.offset
        if _damaged_tail(path, end):
            last = next(reversed(members), None)
            problems.append(f"{path}: the tar headers break off at byte {end}"
                            + (f" (after the sample {last})" if last else "") + "; the rest of the shard is unreadable")
    except (tarfile.TarError, OSError) as e:
        return [], [f"{path}: not a readable tar file ({e})"]
    pairs = []
    for key, found in members.items():
        where = f"{path}:{key}"
        images = [found[e] for e in IMAGE_SUFFIXES if e in found]
        if len(images) > 1:
            problems.append(f"{where}: {len(images)} images ({', '.join(m.name for m in images)}) for one caption")
        elif not images:
            problems.append(f"{where}: a caption without an image ({key}.jpg/.jpeg/.png/.webp)")
        elif CAPTION_SUFFIX not in found:
            problems.append(f"{where}: an image without a caption ({key}.txt)")
        else:
            try:
                caption = captions[key].decode("utf-8").strip()
            except UnicodeDecodeError:
                problems.append(f"{where}: the caption is not UTF-8 text")
                continue
            if not caption:
                problems.append(f"{where}: the caption is empty")
                continue
            m = images[0]
            pairs.append(Pair(where, TarMember(path, m.name, m.offset_data, m.size), caption))
    return pairs, problems


def _bad(problem: str, key: str, bad_images: str, skipped: Skipped) -> None:
    if bad_images == "skip":
        skipped.add(problem)
        return
    raise ConfigError(f"[{key}] {problem} (training.bad_images = \"skip\" leaves such samples out)")


def _items(path: str | None, entries: list[DatasetEntry], section: str) -> list[tuple[str, float, str]]:
    if path:
        return [(path, 1.0, f"{section}.dataset_path")]
    if not entries:
        raise ConfigError(f"[{section}.dataset_path] the image_text dataset needs a folder of .tar shards")
    return [(e.path, e.weight, f"{section}.datasets[{i}]") for i, e in enumerate(entries)]


def check_image_text(path: str | None, entries: list[DatasetEntry], section: str = "training") -> None:
    """The launch check's part: every source names .tar shards (ConfigError naming the key)."""
    for p, _, key in _items(path, entries, section):
        tar_files(p, key)


def image_text_sources(path: str | None, entries: list[DatasetEntry], tokenizer: Tokenizer, seq_len: int,
                       overlong: str, image_spec: ImageSpec | None, bad_images: str = "error",
                       section: str = "training") -> list[ChatSource]:
    """The sources of an `image_text` setting, tokenized and checked (module doc), for `PackedChatDataset`."""
    if image_spec is None:
        raise ConfigError(f"[{section}.dataset] image_text trains a vision-language model, but the model has no "
                          f"vision encoder: choose one that has (e.g. --model.flavor 9B-VL)")
    head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    sources: list[ChatSource] = []
    for p, weight, key in _items(path, entries, section):
        name = os.path.basename(os.path.normpath(p)) or p
        if any(s.name == name for s in sources):
            name = f"{name}#{len(sources)}"
        rendered, images, skipped = [], [], Skipped()
        for shard in tar_files(p, key):
            pairs, problems = index_shard(shard)
            for problem in problems:
                _bad(problem, key, bad_images, skipped)
            for pair in pairs:
                try:
                    grid = image_spec.grid_of(*image_size(pair.image))
                except ConfigError:  # no Pillow: never skipped
                    raise
                except ValueError as e:
                    _bad(f"{pair.where}: {e}", key, bad_images, skipped)
                    continue
                image = image_spec.tokens(grid)
                text = tokenizer.encode(pair.caption, bos=False, eos=True)
                ids, trained, kept = fit(head + image + text, [False] * (len(head) + len(image)) + [True] * len(text),
                                         [(len(head), len(head) + len(image))], seq_len, overlong, pair.where, key)
                rendered.append((ids, trained))
                images.append(((pair.image, grid),)[:kept])
        if skipped.count:
            logger.warning("data: %s: %d sample(s) skipped as unreadable or incomplete (training.bad_images = "
                           "\"skip\"); the first: %s", p, skipped.count, skipped.first)
        if not rendered:
            raise ConfigError(f"[{key}] {p}: no usable image-text pair")
        try:
            sources.append(build_chat_source(name, weight, rendered, seq_len, overlong, images=images,
                                             image_spec=image_spec))
        except ValueError as e:
            raise ConfigError(f"[{key}] {e}") from None
    return sources
