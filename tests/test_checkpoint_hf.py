"""Hugging Face interop, in one process: the RoPE permutation, export -> import round trips (bitwise),
the conversion scripts, bad HF folders, and (with `transformers` installed) logits equal to
LlamaForCausalLM's.

Tolerance of the transformers comparison: max |logit difference| <= 1e-5 in float32. Both models run
the same fp32 arithmetic on bitwise-equal weights; they differ only in how the RoPE angles are
computed (torchtrain in float64 then rounded, HF in float32) and in kernel summation order, which on
this tiny model gives ~3e-7; a wrong permutation, head grouping or RoPE scaling gives errors of 1e-1.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO

from torchtrain.components.checkpoint.folder import read_marker
from torchtrain.components.checkpoint.hf import INDEX_FILE, export_dcp_to_hf, load_hf_into_model, plan_shards
from torchtrain.components.checkpoint.state import ModelState
from torchtrain.components.checkpoint.validate import CheckpointError
from torchtrain.config import ConfigError
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.models.llama3 import Llama3Args, Llama3StateDictAdapter, Transformer
from torchtrain.models.llama3.model import apply_rope, rope_table

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny_args(tied: bool = False) -> Llama3Args:
    # GQA (4 query heads share 2 KV heads) and Llama 3 RoPE scaling active inside the sequence length
    # (original context 16 < 32) so every conversion detail is exercised.
    return Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, max_seq_len=32,
                      rope_original_max_seq_len=16, tie_word_embeddings=tied)


def built(args: Llama3Args, seed: int = 3) -> Transformer:
    model = Transformer(args)
    init_model_weights(model, seed)
    return model


def export(model: Transformer, tmp_path, max_shard_bytes: int = 60_000, dtype=None) -> str:
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = str(tmp_path / "hf")
    export_dcp_to_hf(str(tmp_path / "dcp"), out, Llama3StateDictAdapter(model.args), dtype, max_shard_bytes)
    return out


def rope_rotate_half(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """HF's RoPE: pairs (x[i], x[i + d/2]) rotated by angle i."""
    seq, half = x.shape[1], x.shape[-1] // 2
    cos = table[:seq, 0::2].repeat(1, 2).view(1, seq, 1, 2 * half)  # the table holds (cos, sin) pairs
    sin = table[:seq, 1::2].repeat(1, 2).view(1, seq, 1, 2 * half)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def test_permutation_maps_interleaved_rope_to_rotate_half():
    args = tiny_args()
    adapter = Llama3StateDictAdapter(args)
    wq = torch.randn(args.n_heads * args.head_dim, args.dim, dtype=torch.float64)
    key = "layers.0.attention.wq.weight"
    assert torch.equal(adapter.from_hf(key, adapter.to_hf(key, wq)), wq)
    x = torch.randn(2, 32, args.dim, dtype=torch.float64)
    table = rope_table(args).double()
    ours = apply_rope((x @ wq.T).view(2, 32, args.n_heads, -1), table)
    theirs = rope_rotate_half((x @ adapter.to_hf(key, wq).T).view(2, 32, args.n_heads, -1), table)
    # HF's rotated q equals ours with the same per-head row permutation, so q.k scores are identical.
    # (apply_rope computes in float32: 1e-5 covers its rounding; a wrong permutation is off by O(1).)
    permuted = adapter.to_hf(key, ours.reshape(-1, args.n_heads * args.head_dim).T).T.reshape(theirs.shape)
    torch.testing.assert_close(theirs, permuted, rtol=1e-5, atol=1e-5)


def test_plan_shards():
    assert plan_shards([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards([("a", 4)], 1) == [["a"]]


@pytest.mark.parametrize("tied", [False, True])
def test_export_import_round_trip_is_bitwise(tmp_path, tied):
    model = built(tiny_args(tied))
    out = export(model, tmp_path)
    with open(os.path.join(out, INDEX_FILE)) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 1  # sharded: the threshold is below the model size
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    assert "model.layers.1.self_attn.k_proj.weight" in index["weight_map"]
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["num_key_value_heads"] == 2 and config["rope_scaling"]["rope_type"] == "llama3"
    fresh = built(tiny_args(tied), seed=99)
    warnings, used, available = load_hf_into_model(ModelState([fresh]), out, Llama3StateDictAdapter(fresh.args))
    assert warnings == [] and used == available
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_hf_to_dcp_round_trip_and_scripts(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import convert_dcp_to_hf
    import convert_hf_to_dcp

    model = built(tiny_args())
    hf_dir = export(model, tmp_path)
    overrides = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
                 "--model.vocab_size", "300", "--model.rope_original_max_seq_len", "16", "--training.seq_len", "32"]
    out = str(tmp_path / "step-0")
    assert convert_hf_to_dcp.main([hf_dir, out, *overrides]) == 0
    meta, _ = read_marker(out)
    assert meta["contents"] == ["model"] and meta["model"]["args"]["n_kv_heads"] == 2
    loaded = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": loaded}, checkpoint_id=out, no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    # ... and back to HF (model described by the marker), in bfloat16, one file.
    hf_again = str(tmp_path / "hf_again")
    assert convert_dcp_to_hf.main([out, hf_again, "--dtype", "bfloat16"]) == 0
    fresh = Transformer(tiny_args())
    load_hf_into_model(ModelState([fresh]), hf_again, Llama3StateDictAdapter(fresh.args))
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v.bfloat16().float()), k
    assert convert_dcp_to_hf.main([str(tmp_path / "nowhere"), hf_again]) == 2


def test_bad_hf_folders(tmp_path):
    model = built(tiny_args())
    out = export(model, tmp_path, max_shard_bytes=10**9)  # one model.safetensors
    other = Transformer(tiny_args().replace(n_heads=8))  # same shapes, different head split
    with pytest.raises(ConfigError, match=r"num_attention_heads = 4 but this model has 8 \(model.n_heads\)"):
        load_hf_into_model(ModelState([other]), out, Llama3StateDictAdapter(other.args))
    wider = Transformer(tiny_args().replace(vocab_size=320))
    with pytest.raises(ConfigError, match="vocab_size = 300 but this model has 320"):
        load_hf_into_model(ModelState([wider]), out, Llama3StateDictAdapter(wider.args))
    os.remove(os.path.join(out, "config.json"))
    with pytest.raises(CheckpointError, match=r"'model.embed_tokens.weight' has shape \(300, 64\) but parameter "
                                              r"tok_embeddings.weight has \(320, 64\)"):
        load_hf_into_model(ModelState([wider]), out, Llama3StateDictAdapter(wider.args))
    path = os.path.join(out, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or not a safetensors file"):
        load_hf_into_model(ModelState([Transformer(tiny_args())]), out, Llama3StateDictAdapter(tiny_args()))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_into_model(ModelState([model]), str(tmp_path / "missing"), Llama3StateDictAdapter(tiny_args()))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tmp_path, tied):
    # transformers is in the dev extra; without it (a minimal install) this comparison cannot run.
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
    model = built(tiny_args(tied)).eval()
    hf_dir = export(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).float().eval()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
