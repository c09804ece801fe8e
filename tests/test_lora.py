"""LoRA in one process: frozen base weights and adapter-only optimizer state, the exports (a PEFT
adapter folder that `peft` loads onto the transformers base model, and a merged HF checkpoint) with
logits equal to torchtrain's, the config errors before launch, the layouts LoRA takes, the keys a
checkpoint load asks for, and a compiled adapter layer.

Tolerance of the logit comparisons: 1e-5 absolute in float32 (the same model computed by two
implementations; test_checkpoint_hf.py sees ~3e-7 for the base model, and the adapter adds one
small matmul per layer); a wrong name, row order or scale gives errors of 1e-2 or more."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_hf import built, export, tiny_args

from torchtrain.components.optim.optimizer import _param_groups
from torchtrain.config import ConfigError
from torchtrain.config.lora import Lora
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.launch_check import check
from torchtrain.models.converters.lora import LoRALinear, apply_lora, lora_load_keys
from torchtrain.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtrain.tools.lora_export import load_lora_state, merged_state, write_merged, write_peft

CFG = Lora(enable=True, rank=4, alpha=8.0, target_modules=["*.attention.wq", "*.attention.wv", "w2"])
JOB = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--model.vocab_size", "300", "--model.rope_original_max_seq_len", "16", "--training.seq_len", "32",
       "--training.dataset", "synthetic", "--training.local_batch_size", "2", "--job.print_config", "false",
       "--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8",
       "--lora.target_modules", "*.attention.wq,*.attention.wv,w2"]


def lora_model():
    """The tiny HF-exportable model with adapters whose B is non-zero (so they change the logits)."""
    model = built(tiny_args())
    apply_lora(model, CFG)
    init_model_weights(model, 3)  # the same base weights as built(): values depend on name and seed only
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=g) * 0.1)
    return model.eval()


def test_base_frozen_adapters_trained_and_optimizer_holds_adapters_only():
    model = lora_model()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"layers.{i}.{m}.lora_{ab}.weight" for i in range(2) for ab in "ab"
                               for m in ("attention.wq", "attention.wv", "feed_forward.w2"))
    in_groups = {id(p) for g in _param_groups(model, 0.1) for p in g["params"]}
    assert in_groups == {id(p) for p in model.parameters() if p.requires_grad}
    base = built(tiny_args())
    assert torch.equal(model.layers["0"].attention.wq.weight, base.layers["0"].attention.wq.weight)


def test_peft_loads_the_adapter_and_the_merged_export_loads_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[dev])")
    peft = pytest.importorskip("peft", reason="peft not installed (pip install -e .[dev])")
    base_dir = export(built(tiny_args()), tmp_path)
    model = lora_model()
    adapter = Llama3StateDictAdapter(model.args)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        base = transformers.LlamaForCausalLM.from_pretrained(base_dir).float().eval()
        assert (base(tokens).logits - ours).abs().max() > 1e-2  # the adapters matter

        # the checkpoint a LoRA run saves (DCP, any layout) -> the export command's loader
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "lora_dcp"), no_dist=True)
        state, cfg, adapter = load_lora_state(str(tmp_path / "lora_dcp"), JOB)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())

        write_peft(str(tmp_path / "peft"), state, cfg, adapter, base=base_dir)
        with_adapter = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        assert (with_adapter(tokens).logits - ours).abs().max().item() <= 1e-5

        write_merged(str(tmp_path / "merged"), state, cfg, adapter)
        merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
        assert (merged(tokens).logits - ours).abs().max().item() <= 1e-5
    assert not any(".lora_" in k for k in merged_state(state, cfg))


@pytest.mark.parametrize("extra, key, says", [
    (["--lora.target_modules", "*.attention.wq,*.nothing"], "lora.target_modules", "'*.nothing' (entry 1) matches no"),
    (["--model.converters", "float8", "--quantize.linear.float8.emulate", "true"], "lora.enable", "float8"),
    (["--lora.target_modules", "layers.0.attention.wq", "--parallelism.pipeline_parallel_degree", "2"],
     "lora.target_modules", "pipeline stage 1 (layers.1"),
    (["--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "true",
      "--checkpoint.last_save_in_hf", "true"], "checkpoint.last_save_in_hf", "lora_export"),
])
def test_lora_config_errors_before_launch(extra, key, says):
    with pytest.raises(ConfigError) as e:
        check(["--nproc-per-node", "2", "--nnodes", "1", *JOB, *extra])
    assert str(e.value).startswith(f"[{key}]") and says in str(e.value) and "\n" not in str(e.value)
    assert check(["--nproc-per-node", "2", "--nnodes", "1", *JOB]) == 2


@pytest.mark.parametrize("layout", [["--parallelism.tensor_parallel_degree", "2"],
                                    ["--parallelism.pipeline_parallel_degree", "2"],
                                    ["--parallelism.context_parallel_degree", "2"],
                                    ["--activation_checkpoint.mode", "full"]])
def test_lora_takes_model_parallel_layouts(layout):
    assert check(["--nproc-per-node", "2", "--nnodes", "1", *JOB, *layout]) == 2


def test_checkpoint_loads_ask_for_what_the_checkpoint_holds():
    state = {"a.weight": 0, "a.lora_a.weight": 1, "a.lora_b.weight": 2}
    assert lora_load_keys(state, set(state)) == state  # a LoRA checkpoint: everything
    assert lora_load_keys(state, {"a.weight"}) == {"a.weight": 0}  # no adapters stored: they stay fresh
    assert lora_load_keys(state, {"a.lora_a.weight", "a.lora_b.weight"}) == {"a.lora_a.weight": 1, "a.lora_b.weight": 2}
    assert lora_load_keys({"a.weight": 0}, set()) == {"a.weight": 0}  # no LoRA: unchanged


def test_compiled_adapter_layer_equals_eager():
    layer = apply_lora_to_one(Lora(enable=True, rank=4, alpha=8.0, target_modules=["lin"]))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    eager = layer(x)
    eager.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters() if p.requires_grad]
    layer.zero_grad()
    compiled = torch.compile(layer, backend="aot_eager")(x)
    compiled.square().sum().backward()
    assert torch.allclose(compiled, eager, atol=1e-6)
    trained = [p for p in layer.parameters() if p.requires_grad]
    assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(trained, grads, strict=True))


def apply_lora_to_one(cfg: Lora) -> LoRALinear:
    model = torch.nn.Sequential()
    model.add_module("lin", torch.nn.Linear(16, 8))
    apply_lora(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return model.lin
