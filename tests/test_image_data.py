"""Image data in one process: image chat rows (Jinja template and built-in renderer) and image-text tar
shards (`data/image/image_text.py`) as packed batches -- placeholder runs aligned with `pixel_values` and
`image_grid`, answer/caption-only labels, per-rank disjointness, seeded shuffles, exact resume, packing that
never splits an image -- and every bad input reported naming file:line or shard:key, or counted when skipped.

Pictures come from the shapes tool (32..64 pixels a side); the geometry is patch 8, merge 2, so an image is
4..16 decoder tokens. Pixel values are compared exactly: the batch decodes the same file with the same code."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tarfile

import pytest
import torch
from vlm_assets import write_tokenizer

from torchtrain.config import ConfigError
from torchtrain.config.training import DatasetEntry
from torchtrain.data.bad_input import PrepareError
from torchtrain.data.build import check_sources
from torchtrain.data.chat.conversations import chat_sources
from torchtrain.data.chat.packing import PackedChatDataset
from torchtrain.data.chat.records import read_conversations
from torchtrain.data.chat.token_store import prepare_chat
from torchtrain.data.image.image_text import image_text_sources
from torchtrain.data.image.pixels import ImageSpec, open_image
from torchtrain.data.loader import DataLoader
from torchtrain.data.tokenizer import ByteTokenizer, build_tokenizer
from torchtrain.tools import shapes
from torchtrain.utils.logging import logger
from torchtrain.utils.token_loss import IGNORE_INDEX

pytest.importorskip("PIL")
GEOMETRY = dict(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    assert shapes.main([str(root / "set"), "--train", "12", "--test", "2", "--tars", "2"]) == 0
    tok = build_tokenizer(write_tokenizer(str(root / "tok")) and str(root / "tok"))
    return root / "set", tok, ImageSpec.from_tokenizer(tok, **GEOMETRY)


def runs(ids: torch.Tensor, spec: ImageSpec) -> list[tuple[int, int]]:
    """(position of <|vision_start|>, pads after it) of each image run of a row; asserts each run is whole."""
    out, ids = [], ids.tolist()
    for i, t in enumerate(ids):
        if t == spec.vision_start_id:
            n = 0
            while i + 1 + n < len(ids) and ids[i + 1 + n] == spec.image_pad_id:
                n += 1
            assert i + 1 + n < len(ids) and ids[i + 1 + n] == spec.vision_end_id, "an image run is cut"
            out.append((i, n))
    assert sum(n for _, n in out) == ids.count(spec.image_pad_id)
    return out


def check_batch(ds: PackedChatDataset, indices: list[int], spec: ImageSpec) -> dict[str, torch.Tensor]:
    """The batch of `indices`, its image keys checked against its placeholder runs and the files."""
    batch = ds.__getitems__(indices)
    assert batch["pixel_values"].dtype == torch.float32 and batch["image_grid"].dtype == torch.int64
    b, most_p, dim = batch["pixel_values"].shape
    assert b == len(indices) and dim == spec.patch_dim and batch["image_grid"].shape[0] == b
    for row, g in enumerate(indices):
        images, grid = ds.row_images(g), batch["image_grid"][row]
        found = runs(batch["input_ids"][row], spec)
        assert [n for _, n in found] == [spec.token_count(gr) for _, gr in images]
        assert [tuple(x) for x in grid[:len(images)].tolist()] == [gr for _, gr in images]
        assert not grid[len(images):].any()
        pads = batch["input_ids"][row] == spec.image_pad_id
        assert (batch["labels"][row][pads] == IGNORE_INDEX).all()  # image tokens are never trained
        at = 0
        for ref, gr in images:
            patches, _ = spec.patches(open_image(ref))
            assert torch.equal(batch["pixel_values"][row, at:at + len(patches)], patches)
            at += len(patches)
        assert not batch["pixel_values"][row, at:].any()
    assert most_p == max(sum(gr[1] * gr[2] for _, gr in ds.row_images(g)) for g in indices)
    return batch


def image_ids(batch: dict[str, torch.Tensor], spec: ImageSpec) -> list[list[str]]:
    """Per row, a digest of each image's patches (which pictures a row holds)."""
    out = []
    for pixels, grids in zip(batch["pixel_values"], batch["image_grid"]):
        at, row = 0, []
        for t, h, w in grids.tolist():
            if t:
                row.append(hashlib.sha1(pixels[at:at + t * h * w].numpy().tobytes()).hexdigest())
                at += t * h * w
        out.append(row)
    return out


def test_image_chat_rows_with_the_jinja_template(data):
    folder, tok, spec = data
    (source,) = chat_sources(str(folder / "train.jsonl"), [], tok, 128, "truncate", image_spec=spec)
    ds = PackedChatDataset([source], 128, shuffle=False)
    rows = ds.epoch_rows(0, 0)
    batch = check_batch(ds, list(range(len(rows))), spec)
    answers = [c.turns[-1][1] for c in read_conversations(str(folder / "train.jsonl"))]
    for r, row in enumerate(rows):
        starts = (batch["positions"][r] == 0).nonzero().flatten().tolist()
        assert starts[:len(row)] == [0, *[int(x) for x in (source.ends[row] - source.starts[row] - 1).cumsum()[:-1]]]
        labels = batch["labels"][r]
        text = tok.decode(labels[labels != IGNORE_INDEX].tolist())
        assert text == "".join(f"{answers[c]}\n" for c in row)  # answer, <|im_end|> (decoded as ""), newline
        assert (labels == tok.eos_id).sum() == len(row)
        assert len(runs(batch["input_ids"][r], spec)) == len(row)  # one picture per conversation


def test_image_chat_with_the_builtin_renderer_and_two_images(data, tmp_path):
    folder, _, _ = data
    spec = ImageSpec(**GEOMETRY, image_pad_id=258, vision_start_id=259, vision_end_id=260)
    record = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image", "path": "images/00000.png"},
        {"type": "text", "text": " and "}, {"type": "image", "path": "images/00001.png"}]},
        {"role": "assistant", "content": "two shapes"}]}
    file = folder / "pairs.jsonl"
    file.write_text(json.dumps(record) + "\n")
    (source,) = chat_sources(str(file), [], ByteTokenizer(), 96, "truncate", image_spec=spec)
    ds = PackedChatDataset([source], 96, shuffle=False)
    batch = check_batch(ds, [0], spec)
    ids = batch["input_ids"][0].tolist()
    (a, n), (b, m) = runs(batch["input_ids"][0], spec)
    assert bytes(ids[1:a]) == b"User: Compare " and bytes(ids[a + n + 2:b]) == b" and "
    assert [ref for ref, _ in ds.row_images(0)] == [str(folder / "images/00000.png"), str(folder / "images/00001.png")]
    labels = batch["labels"][0]
    assert labels[labels != IGNORE_INDEX].tolist() == list(b"two shapes") + [ByteTokenizer.eos_id]


def test_overlong_conversations_are_cut_before_an_image_never_inside(data):
    folder, _, _ = data
    spec = ImageSpec(**GEOMETRY, image_pad_id=258, vision_start_id=259, vision_end_id=260)
    record = {"messages": [
        {"role": "user", "content": [{"type": "image", "path": "images/00000.png"}]},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": [{"type": "image", "path": "images/00001.png"}]},
        {"role": "assistant", "content": "second answer"}]}
    file = folder / "two_turns.jsonl"
    file.write_text(json.dumps(record) + "\n")
    (whole,) = chat_sources(str(file), [], ByteTokenizer(), 512, "truncate", image_spec=spec)
    n = int(whole.ends[0] - whole.starts[0])
    ids, _ = whole.store.read(0, n)
    second = ids.tolist().index(259, ids.tolist().index(260))  # the second run's <|vision_start|>
    end = ids.tolist().index(260, second) + 1  # and the token after its <|vision_end|>
    kept = set()
    for seq_len in range(second - 2, n - 1):
        (src,) = chat_sources(str(file), [], ByteTokenizer(), seq_len, "truncate", image_spec=spec)
        ds = PackedChatDataset([src], seq_len, shuffle=False)
        check_batch(ds, [0], spec)  # every run whole, one grid per run
        kept.add(len(ds.row_images(0)))
        assert len(ds.row_images(0)) == (2 if end <= seq_len else 1)
        assert src.num_tokens == (min(n, seq_len + 1) if end <= seq_len else min(second, seq_len + 1))
    assert kept == {1, 2}
    with pytest.raises(ConfigError, match="raise training.seq_len or lower images.max_pixels"):
        chat_sources(str(file), [], ByteTokenizer(), 5, "truncate", image_spec=spec)


def test_image_text_rows_layout_and_caption_labels(data):
    folder, tok, spec = data
    (source,) = image_text_sources(str(folder / "tars"), [], tok, 64, "truncate", spec)
    assert source.num_conversations == 12
    ds = PackedChatDataset([source], 64, shuffle=False)
    rows = ds.epoch_rows(0, 0)
    assert len(rows) < 12  # several pairs per row
    batch = check_batch(ds, list(range(len(rows))), spec)
    captions = {}
    for k in range(2):
        with tarfile.open(folder / "tars" / f"shard-{k}.tar") as tar:
            captions.update({m.name[:-4]: tar.extractfile(m).read().decode() for m in tar if m.name.endswith("txt")})
    order = sorted(captions, key=lambda key: (int(key) % 2, key))  # shard 0's keys, then shard 1's
    for r, row in enumerate(rows):
        labels = batch["labels"][r]
        assert tok.decode(labels[labels != IGNORE_INDEX].tolist()) == "".join(captions[order[c]] for c in row)
        assert (labels == tok.eos_id).sum() == len(row)  # caption + EOS trained
        for start, _ in runs(batch["input_ids"][r], spec):
            assert batch["positions"][r, start] == 0  # the image opens each sample (no BOS in this tokenizer)


def test_image_text_ranks_are_disjoint_and_epochs_reshuffle(data):
    folder, tok, spec = data
    sources = image_text_sources(str(folder / "tars"), [], tok, 64, "truncate", spec)
    ds = PackedChatDataset(sources, 64, seed=3)
    rows = len(ds.epoch_rows(0, 0))
    epoch = [x for row in image_ids(ds.__getitems__(list(range(rows))), spec) for x in row]
    assert len(epoch) == len(set(epoch)) == 12  # every picture once per epoch
    per_rank = [[x for batch in DataLoader(ds, 1, r, 2, limit=rows - rows % 2) for row in image_ids(batch, spec)
                 for x in row] for r in range(2)]
    assert not set(per_rank[0]) & set(per_rank[1]) and set(per_rank[0]) | set(per_rank[1]) <= set(epoch)
    again = [x for row in image_ids(ds.__getitems__(list(range(rows, rows + len(ds.epoch_rows(0, 1))))), spec)
             for x in row]
    other_seed = PackedChatDataset(sources, 64, seed=4)
    reseeded = [x for row in image_ids(other_seed.__getitems__(list(range(rows))), spec) for x in row]
    assert sorted(again) == sorted(epoch) == sorted(reseeded)
    assert again != epoch and reseeded != epoch


def test_image_text_resume_is_exact(data):
    folder, tok, spec = data

    def loader():
        sources = image_text_sources(str(folder / "tars"), [], tok, 48, "truncate", spec)
        return DataLoader(PackedChatDataset(sources, 48, seed=1), 2, 1, 2, log_epochs=False)

    first = loader()
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    expected = [next(it) for _ in range(4)]  # crosses into the second epoch
    resumed = loader()
    resumed.load_state_dict(state)
    for want, got in zip(expected, resumed):
        assert want.keys() == got.keys() == {"input_ids", "labels", "positions", "pixel_values", "image_grid"}
        for key in want:
            assert torch.equal(want[key], got[key]), key
    assert resumed.samples > state["samples"]


def test_an_image_larger_than_seq_len_names_the_sample_and_the_fix(data):
    folder, tok, spec = data
    big = ImageSpec(**{**GEOMETRY, "min_pixels": 64 * 64, "max_pixels": 128 * 128},
                    image_pad_id=spec.image_pad_id, vision_start_id=spec.vision_start_id,
                    vision_end_id=spec.vision_end_id)
    with pytest.raises(ConfigError, match=r"^\[training.dataset_path\] .*shard-0.tar:00000: an image takes \d+ tokens, "
                                          r"more than training.seq_len 12; raise training.seq_len or lower "
                                          r"images.max_pixels"):
        image_text_sources(str(folder / "tars"), [], tok, 12, "truncate", big)
    with pytest.raises(ConfigError, match=r"train.jsonl:1: an image takes .* raise training.seq_len"):
        chat_sources(str(folder / "train.jsonl"), [], tok, 12, "truncate", image_spec=big)


def write_tar(path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, payload in members.items():
            shapes._add(tar, name, payload)
    return str(path)


@pytest.mark.parametrize("members, says", [
    ({"b.txt": b"a caption"}, "b: a caption without an image"),
    ({"b.png": None}, "b: an image without a caption"),
    ({"b.png": b"\x89PNG garbage", "b.txt": b"x"}, "b: cannot read image"),
    ({"b.png": None, "b.jpg": None, "b.txt": b"x"}, "b: 2 images"),
    ({"b.png": None, "b.txt": b"  "}, "b: the caption is empty"),
    ({"b.png": None, "b.txt": b"\xff\xfe"}, "b: the caption is not UTF-8"),
])
def test_bad_shard_samples_are_errors_or_counted_skips(data, tmp_path, caplog, members, says):
    folder, tok, spec = data
    picture = (folder / "images" / "00003.png").read_bytes()
    os.makedirs(tmp_path / "tars")
    write_tar(tmp_path / "tars" / "a.tar", {"a.png": picture, "a.txt": b"a red square",
                                             **{k: picture if v is None else v for k, v in members.items()}})
    with pytest.raises(ConfigError) as e:
        image_text_sources(str(tmp_path / "tars"), [], tok, 64, "truncate", spec)
    assert "\n" not in str(e.value) and f"a.tar:{says}" in str(e.value) and 'bad_images = "skip"' in str(e.value)
    caplog.set_level(logging.WARNING, logger=logger.name)
    logger.addHandler(caplog.handler)
    try:
        (source,) = image_text_sources(str(tmp_path / "tars"), [], tok, 64, "truncate", spec, bad_images="skip")
    finally:
        logger.removeHandler(caplog.handler)
    assert source.num_conversations == 1
    (line,) = {r.getMessage() for r in caplog.records if "skipped" in r.getMessage()}
    assert "1 sample(s) skipped" in line and says in line


def test_damaged_tars_name_the_shard(data, tmp_path):
    folder, tok, spec = data
    whole = (folder / "tars" / "shard-0.tar").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "s.tar").write_bytes(whole[:len(whole) // 2 + 100])
    with pytest.raises(ConfigError, match=r"s\.tar.*(cut off by the end of the file|break off)"):
        image_text_sources(str(tmp_path / "cut"), [], tok, 64, "truncate", spec)
    (tmp_path / "bad").mkdir()
    with tarfile.open(folder / "tars" / "shard-0.tar") as tar:
        at = tar.getmembers()[4].offset  # the third sample's header: a checksum that no longer matches
    (tmp_path / "bad" / "s.tar").write_bytes(whole[:at] + b"\x01" * 100 + whole[at + 100:])
    with pytest.raises(ConfigError, match=rf"s\.tar: the tar headers break off at byte {at} \(after the sample 00002\)"):
        image_text_sources(str(tmp_path / "bad"), [], tok, 64, "truncate", spec)
    with pytest.raises(ConfigError, match=r"^\[training.dataset_path\] .*holds no .tar shards"):
        check_sources("image_text", str(folder / "images"), [], "text", 64, tok)
    with pytest.raises(ConfigError, match=r"the model has no vision encoder"):
        image_text_sources(str(folder / "tars"), [], tok, 64, "truncate", None)
    mixture = image_text_sources(None, [DatasetEntry(str(folder / "tars" / "shard-0.tar"), 1.0),
                                        DatasetEntry(str(folder / "tars" / "shard-1.tar"), 2.0)], tok, 64, "truncate",
                                 spec)
    assert [s.num_conversations for s in mixture] == [6, 6]


@pytest.mark.parametrize("part, says", [
    ({"type": "image", "path": "images/missing.png"}, "no image at"),
    ({"type": "image", "path": "garbage.png"}, "cannot read image"),
])
def test_bad_chat_images_are_errors_or_counted_skips(data, tmp_path, caplog, part, says):
    folder, tok, spec = data
    shutil.copytree(folder / "images", tmp_path / "images")
    (tmp_path / "garbage.png").write_bytes(b"not a png")
    good = json.loads((folder / "train.jsonl").read_text().splitlines()[0])
    bad = {"messages": [{"role": "user", "content": [part]}, {"role": "assistant", "content": "x"}]}
    file = tmp_path / "chat.jsonl"
    file.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ConfigError, match=rf"^\[training.dataset_path\] {file}:2: {says}"):
        chat_sources(str(file), [], tok, 128, "truncate", image_spec=spec)
    caplog.set_level(logging.WARNING, logger=logger.name)
    logger.addHandler(caplog.handler)
    try:
        (source,) = chat_sources(str(file), [], tok, 128, "truncate", image_spec=spec, bad_images="skip")
    finally:
        logger.removeHandler(caplog.handler)
    assert source.num_conversations == 1
    (line,) = {r.getMessage() for r in caplog.records if "skipped" in r.getMessage()}
    assert "1 conversation(s) skipped" in line and f"{file}:2" in line


def test_image_records_refused_without_a_vision_model_outside_the_folder_and_when_prepared(data, tmp_path):
    folder, tok, spec = data
    train = str(folder / "train.jsonl")
    with pytest.raises(ConfigError, match=rf"{train}:1: the conversation holds an image, but the model has no vision"):
        chat_sources(train, [], tok, 128, "truncate")
    for path in ("../outside.png", "/etc/passwd"):
        bad = {"messages": [{"role": "user", "content": [{"type": "image", "path": path}]},
                            {"role": "assistant", "content": "x"}]}
        (tmp_path / "chat.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(ConfigError, match=r"chat.jsonl:1: turn 0 \(user\) part 0: image path .* stay inside it"):
            chat_sources(str(tmp_path / "chat.jsonl"), [], tok, 128, "truncate", image_spec=spec)
    with pytest.raises(PrepareError, match=rf"{train}:1: the conversation holds an image; prepared chat folders"):
        prepare_chat([train], str(tmp_path / "prepared"), str(folder.parent / "tok"), show_progress=False,
                     log=lambda _: None)
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "yo"}]}) + "\n")
    (source,) = chat_sources(str(text_only), [], tok, 32, "truncate", image_spec=spec)
    assert PackedChatDataset([source], 32).__getitems__([0]).keys() == {"input_ids", "labels", "positions"}


def test_the_vision_language_model_reads_the_batches(data):
    """The batch schema as `qwen3_5` with its vision encoder takes it: a forward and backward on packed rows."""
    from torchtrain.distributed.param_init import init_model_weights
    from torchtrain.models.qwen3_5 import Qwen3_5Args, build

    folder, tok, spec = data
    args = Qwen3_5Args(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=264, hidden_dim=48,
                       max_seq_len=64, full_attention_interval=2, linear_num_key_heads=1, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_attn_chunk_size=16,
                       partial_rotary_factor=0.5, vision_depth=1, vision_dim=16, vision_heads=2,
                       vision_hidden_dim=32, vision_patch_size=8, vision_num_position_embeddings=16,
                       image_token_id=spec.image_pad_id, vision_start_token_id=spec.vision_start_id,
                       vision_end_token_id=spec.vision_end_id)
    model = build(args)
    init_model_weights(model, 0)
    ds = PackedChatDataset(image_text_sources(str(folder / "tars"), [], tok, 64, "truncate", spec), 64)
    batch = model.batch_inputs(ds.__getitems__([0, 1]))
    logits = model(batch["input_ids"], **{k: v for k, v in batch.items() if k not in ("input_ids", "labels")})
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.startswith("vision_encoder.")]
    assert torch.isfinite(loss) and all(g is not None for g in grads) and any(g.any() for g in grads)


def test_missing_pillow_stops_the_build_even_when_skipping(data, monkeypatch):
    import builtins

    folder, tok, spec = data
    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "PIL" or name.startswith("PIL.") else real(name, *a, **k))
    for build in (lambda: chat_sources(str(folder / "train.jsonl"), [], tok, 128, "truncate", image_spec=spec,
                                       bad_images="skip"),
                  lambda: image_text_sources(str(folder / "tars"), [], tok, 64, "truncate", spec, bad_images="skip")):
        with pytest.raises(ConfigError) as e:
            build()
        assert str(e.value) == "reading images needs Pillow: pip install 'torchtrain[vision]'"
