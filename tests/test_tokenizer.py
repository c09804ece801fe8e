"""Tokenizers: byte-level round trip, and an HF tokenizer.json (built here, no download)."""

from __future__ import annotations

import json

import pytest

from torchtrain.components.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from torchtrain.config import ConfigError

TEXTS = ["hello world", "", "naïve café — 東京 🚀", "def f(x):\n    return x * 2\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=False, eos=False) == list(text.encode("utf-8"))


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="`tokenizers` (the [hf] extra) reads tokenizer.json")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_tokenizer_round_trip(hf_tokenizer_dir):
    tok = build_tokenizer(str(hf_tokenizer_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_id == 0 and tok.eos_id == 1
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert tok.decode(ids) == text
    # the file itself is accepted as well as its folder, and BOS/EOS can come from tokenizer_config.json
    (hf_tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|begin_of_text|>"}))
    assert HFTokenizer(str(hf_tokenizer_dir / "tokenizer.json")).eos_id == 0


def test_hf_tokenizer_errors(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        HFTokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        HFTokenizer(str(tmp_path))
