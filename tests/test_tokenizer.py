"""Tokenizers: byte-level round trip, and an HF tokenizer.json (built here, no download)."""

from __future__ import annotations

import json

import pytest

from torchtrain.config import ConfigError
from torchtrain.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

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


def _bpe_ranks(texts: list[str], merges: int) -> dict[bytes, int]:
    """A tiny BPE vocabulary learned from `texts`: the 256 bytes, then the most frequent adjacent pairs."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for t in texts for w in t.split()]
    for _ in range(merges):
        pairs: dict[tuple[bytes, bytes], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


@pytest.fixture
def tiktoken_file(tmp_path):
    pytest.importorskip("tiktoken", reason="`tiktoken` (the [tiktoken] extra) reads tokenizer.model files")
    import base64

    ranks = _bpe_ranks(TEXTS * 3 + ["hello hello hello world world"], merges=40)
    with open(tmp_path / "tokenizer.model", "w") as f:
        for token, rank in ranks.items():
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return tmp_path / "tokenizer.model", ranks


def test_tiktoken_bpe_file_llama3_layout(tiktoken_file):
    from torchtrain.data.tokenizer import TiktokenTokenizer

    path, ranks = tiktoken_file
    tok = build_tokenizer(str(path.parent))  # the folder: tokenizer.model found
    assert isinstance(tok, TiktokenTokenizer)
    n = len(ranks)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 1, n + 256)  # Llama 3: 256 specials after BPE
    for text in TEXTS + ["<|end_of_text|> is plain text inside a document"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and all(i < n for i in ids[1:-1])
        assert tok.decode(ids) == text
    assert tok.encode("hello", bos=False, eos=False) == [ranks[b"hello"]]  # merges applied
    assert tok.identity["kind"] == "tiktoken" and len(tok.identity["sha256"]) == 64
    path.write_text("not base64 at all\n")
    with pytest.raises(ConfigError, match="line 1 is not `base64-token rank`"):
        build_tokenizer(str(path))
