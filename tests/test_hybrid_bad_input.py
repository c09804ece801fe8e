"""Bad input for the hybrid and sink architectures is one `torchtrain: config error: ...` line naming the key
or file, exit code 2, before any step: a TP degree that does not divide the linear-attention heads, a
context-parallel chunk shorter than the linear layers' convolution, flash-linear-attention asked for but
missing, and an MXFP4 expert file whose blocks do not fit. The layout checks run in the launch check's
process (no torchrun); the MXFP4 file is read by the trainer itself at its initial load."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, assert_no_traceback

from torchtrain.config import ConfigError
from torchtrain.launch_check import check
from torchtrain.models.common.delta_rule import fla_available

QWEN = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel", "--training.dataset", "synthetic",
        "--training.seq_len", "64", "--training.local_batch_size", "2"]
P = "--parallelism."


@pytest.mark.parametrize("extra,message", [
    ([f"{P}tensor_parallel_degree", "2", "--model.linear_num_key_heads", "3", "--model.linear_num_value_heads", "6"],
     r"\[model.linear_num_key_heads\] 3 is not divisible by parallelism.tensor_parallel_degree 2"),
    ([f"{P}context_parallel_degree", "2", "--training.seq_len", "8"],
     r"\[training.seq_len\] context parallelism cuts each sequence into chunks of 2 tokens, shorter than the linear "
     r"layers' convolution \(model.linear_conv_kernel_dim 4\)"),
    (["--model.linear_attn_kernel", "fla"], r"\[model.linear_attn_kernel\] \"fla\" needs flash-linear-attention"),
])
def test_layout_errors_name_the_key(extra, message):
    if "fla" in extra and fla_available():
        pytest.skip("flash-linear-attention is installed")
    with pytest.raises(ConfigError, match=message):
        check(["--nproc-per-node", "2", *QWEN, *extra])


def test_an_mxfp4_file_that_does_not_fit_is_one_line_naming_it(tmp_path):
    """The trainer's initial load of a gpt-oss folder whose MXFP4 blocks are cut short."""
    from safetensors.torch import load_file, save_file
    from test_gpt_oss import HF, quantize_mxfp4, transformers

    transformers.GptOssForCausalLM(transformers.GptOssConfig(**HF)).save_pretrained(tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks[..., :8].contiguous(), scales
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    job = ["--model.name", "gpt_oss", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
           "--model.n_kv_heads", "2", "--model.head_dim", "16", "--model.vocab_size", "300",
           "--model.num_experts", "4", "--model.moe_intermediate_size", "32", "--model.sliding_window", "8",
           "--model.rope_factor", "4", "--model.rope_original_max_seq_len", "16", "--training.dataset", "synthetic",
           "--training.seq_len", "32", "--training.local_batch_size", "1", "--training.steps", "1",
           "--checkpoint.enable", "true", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
           "--checkpoint.initial_load_in_hf", "true",
           "--job.dump_folder", str(tmp_path / "out")]
    out = subprocess.run([sys.executable, "-m", "torchtrain.train", *job], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("torchtrain: config error: ")]
    assert len(errors) == 1 and "model.safetensors" in errors[0] and "MXFP4 blocks" in errors[0], out.stderr[-3000:]
    assert_no_traceback(out.stderr)
