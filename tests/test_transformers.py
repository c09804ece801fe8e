"""transformers models (`--model.name transformers --model.hf_path DIR`) in one process: logits equal to
transformers' own forward, the model's own initialisation, the export back to a transformers folder, a
PEFT adapter that `peft` loads, the MoE layer swapped in for expert parallelism, and the config errors of
layouts and inputs that cannot apply. (Training under every layout: tests/test_transformers_train.py.)

Tolerance of the logit comparisons: 1e-5 absolute in float32 -- the same transformers code on the same
weights; torchtrain's attention (SDPA with its own masks, explicit scores under soft-capping) differs from
transformers' kernels in summation order only (0 to ~5e-6 seen), while a wrong mask, window, scale,
soft-cap, position or weight gives errors of 1e-3 or more (logits are O(1): the weights are drawn with
std 0.2). Soft-capped models are compared with transformers' eager attention (`theirs`)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers_folders import hf_folder, transformers

from torchtrain.components.checkpoint.hf import export_dcp_to_hf, load_hf_into_model
from torchtrain.components.checkpoint.state import ModelState
from torchtrain.config import ConfigError, parse_args
from torchtrain.config.lora import Lora
from torchtrain.distributed.parallelize import materialize
from torchtrain.launch_check import check
from torchtrain.models.converters.lora import LoRALinear, LoRAStateDictAdapter, apply_lora
from torchtrain.models.registry import build_model_args, get_model_spec
from torchtrain.models.transformers import moe
from torchtrain.tools.lora_export import load_lora_state, write_merged, write_peft
from torchtrain.trainer.preflight import preflight

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOL = 1e-5
SPEC = get_model_spec("transformers")
DENSE = ["mistral", "qwen2", "phi3", "gemma2", "gemma3", "olmo2"]


def tokens(vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))


def ours(folder: str, load: bool = True, lora: Lora | None = None, swap: bool = False, **overrides) -> torch.nn.Module:
    """The torchtrain model of `folder` in one process: built on meta (its MoE blocks swapped for the engine's
    layer when `swap`, as expert parallelism does), initialised, the folder's weights loaded."""
    args = build_model_args(SPEC, "debugmodel", {"hf_path": folder, **overrides})
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    if swap:
        assert moe.swap_blocks(model) == 2
    if lora is not None:
        apply_lora(model, lora)
    materialize(model, torch.device("cpu"), cpu_offload=False, seed=0)
    if load:
        adapter = SPEC.state_dict_adapter(args)
        _, used, available = load_hf_into_model(ModelState([model]), folder,
                                                LoRAStateDictAdapter(adapter) if lora else adapter)
        assert used == available
    return model.eval()


def theirs(folder: str) -> torch.nn.Module:
    """transformers' model of `folder` under the attention implementation transformers picks (SDPA where the
    model allows it, as torchtrain's attention), but eager where the model soft-caps its attention scores:
    SDPA has no soft-capping, and transformers 5.17 still picks it for Gemma 2, dropping the cap (later
    versions refuse SDPA there). The eager attention is the model's own definition."""
    softcap = getattr(transformers.AutoConfig.from_pretrained(folder), "attn_logit_softcapping", None)
    kwargs = {"attn_implementation": "eager"} if softcap is not None else {}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).float().eval()


@pytest.mark.parametrize("kind", DENSE + ["mixtral", "gpt_oss", "qwen3_5"])
def test_logits_equal_transformers_forward(kind, tmp_path):
    folder = hf_folder(tmp_path, kind)
    with torch.no_grad():
        ref = theirs(folder)(tokens()).logits
        assert ref.abs().max() > 0.5  # not a degenerate model
        assert (ours(folder)(tokens()) - ref).abs().max().item() <= TOL


def test_block_causal_attention_equals_each_document_alone(tmp_path):
    folder = hf_folder(tmp_path, "mistral")  # its sliding window (16) is shorter than the sequence too
    model, hf = ours(folder, attention_mask="block_causal"), theirs(folder)
    positions = torch.cat([torch.arange(10), torch.arange(22)]).expand(2, -1)
    with torch.no_grad():
        alone = torch.cat([hf(tokens()[:, :10]).logits, hf(tokens()[:, 10:]).logits], dim=1)
        assert (model(tokens(), positions=positions) - alone).abs().max().item() <= TOL


def test_linear_attention_runs_as_the_engines_layer(tmp_path):
    """Qwen3.5's Gated DeltaNet layers become the engine's (TP, CP and documents reach them): packed documents
    equal each document alone, and the parameters kept apart write back into transformers' fused tensors
    exactly (an export transformers loads)."""
    from torchtrain.models.transformers.linear_attention import TransformersGatedDeltaNet

    folder = hf_folder(tmp_path, "qwen3_5")
    model, hf = ours(folder, attention_mask="block_causal"), theirs(folder)
    assert sum(isinstance(m, TransformersGatedDeltaNet) for m in model.modules()) == 1
    positions = torch.cat([torch.arange(10), torch.arange(22)]).expand(2, -1)
    with torch.no_grad():
        alone = torch.cat([hf(tokens()[:, :10]).logits, hf(tokens()[:, 10:]).logits], dim=1)
        assert (model(tokens(), positions=positions) - alone).abs().max().item() <= TOL
    adapter = SPEC.state_dict_adapter(model.args)
    exported = adapter.to_hf_state(model.state_dict().items())
    assert exported.keys() == hf.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in hf.state_dict().items())


def test_the_initialisation_is_the_models_own(tmp_path):
    folder = hf_folder(tmp_path, "gemma3", weights=False)
    model = ours(folder, load=False)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.zeros(64))  # Gemma's norms scale by 1 + weight
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - 0.2) < 0.02  # initializer_range
    for name, buf in hf.named_buffers():  # rotary tables and embedding scale recomputed as transformers does
        assert torch.equal(dict(model.named_buffers())[name], buf), name
    again = ours(folder, load=False)
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())  # keyed by name and seed only


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_exports_to_a_folder_transformers_loads(tied, tmp_path):
    folder = hf_folder(tmp_path / "src", "gemma3", tokenizer=True, tie_word_embeddings=tied)
    model = ours(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    dcp.save({"model": ModelState([model]).state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = str(tmp_path / "hf")
    export_dcp_to_hf(str(tmp_path / "dcp"), out, SPEC.state_dict_adapter(model.args))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Gemma3ForCausalLM"]
    with torch.no_grad():
        assert (theirs(out)(tokens()).logits - model(tokens())).abs().max().item() <= TOL


def test_peft_loads_the_lora_adapter_with_equal_logits(tmp_path):
    peft = pytest.importorskip("peft", reason="peft not installed (pip install -e .[dev])")
    folder = hf_folder(tmp_path / "base", "qwen2")
    cfg = Lora(enable=True, rank=4, alpha=8.0, target_modules=["q_proj", "*.mlp.down_proj", "lm_head"])
    model = ours(folder, lora=cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.copy_(torch.randn(m.lora_b.weight.shape, generator=g) * 0.1)
        logits = model(tokens())
        assert (theirs(folder)(tokens()).logits - logits).abs().max() > 1e-2  # the adapters matter
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    dcp.save({"model": adapters}, checkpoint_id=str(tmp_path / "adapters"), no_dist=True)  # an adapter-only save
    job = ["--model.name", "transformers", "--model.hf_path", folder, "--lora.enable", "true", "--lora.rank", "4",
           "--lora.alpha", "8", "--lora.target_modules", "q_proj,*.mlp.down_proj,lm_head"]
    state, lora_cfg, adapter = load_lora_state(str(tmp_path / "adapters"), job)
    write_peft(str(tmp_path / "peft"), state, lora_cfg, adapter, base=folder)
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(theirs(folder), str(tmp_path / "peft")).eval()
        assert (loaded(tokens()).logits - logits).abs().max().item() <= TOL
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "full"), no_dist=True)
    state, lora_cfg, adapter = load_lora_state(str(tmp_path / "full"), job)
    write_merged(str(tmp_path / "merged"), state, lora_cfg, adapter)
    with torch.no_grad():  # merged: (W + s B A) x rounds differently from W x + s B (A x), ~1e-5 on logits of ~6
        assert (theirs(str(tmp_path / "merged"))(tokens()).logits - logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind, semantics", [("mixtral", ("softmax", True, "halves")),
                                             ("qwen3_moe", ("softmax", False, "halves")),
                                             ("gpt_oss", ("softmax", True, "interleaved"))])  # biased, clamped
def test_moe_blocks_swap_for_the_engines_layer_with_equal_logits(kind, semantics, tmp_path):
    folder = hf_folder(tmp_path, kind)  # stored one tensor per expert: read through transformers' conversion
    model, swapped = ours(folder), ours(folder, swap=True)
    block = swapped.model.layers[0].mlp
    assert isinstance(block, moe.TransformersMoE)
    assert (block.score_func, block.norm_topk_prob, block.experts.layout) == semantics
    assert set(dict(model.named_parameters())) == set(dict(swapped.named_parameters()))  # the same names
    with torch.no_grad():
        assert (swapped(tokens()) - model(tokens())).abs().max().item() <= TOL
    fresh, fresh_swapped = ours(folder, load=False), ours(folder, load=False, swap=True)
    for name, p in fresh_swapped.named_parameters():  # initialised as the modules they replaced
        assert torch.equal(p, dict(fresh.named_parameters())[name]), name


@pytest.mark.parametrize("kind, changes, says", [
    ("qwen2_moe", {}, "has parameters shared_expert"),
    ("mixtral", {"router_jitter_noise": 0.1}, "jitter noise"),
])
def test_a_router_the_moe_layer_does_not_reproduce_is_refused_for_ep(kind, changes, says, tmp_path):
    folder = hf_folder(tmp_path, kind, weights=False, **changes)
    with pytest.raises(ConfigError, match=r"^\[parallelism.expert_parallel_degree\] model type") as e:
        job(folder, 2, "--parallelism.expert_parallel_degree", "2")
    assert says in str(e.value)


def job(folder: str, nproc: int, *extra: str) -> int:
    return check(["--nproc-per-node", str(nproc), "--nnodes", "1", "--model.name", "transformers", "--model.hf_path",
                  folder, "--training.dataset", "synthetic", "--training.seq_len", "32", *extra])


def test_layouts_the_model_cannot_take_are_one_config_error(tmp_path, monkeypatch):
    folder = hf_folder(tmp_path / "m", "mistral", weights=False)
    cases = [
        (["--parallelism.pipeline_parallel_degree", "2"], "parallelism.pipeline_parallel_degree",
         "'gemma2': its forward transforms the embeddings or the logits beyond its layers",
         hf_folder(tmp_path / "gemma2", "gemma2", weights=False)),
        (["--parallelism.pipeline_parallel_degree", "2"], "parallelism.pipeline_parallel_degree", "ties its input",
         hf_folder(tmp_path / "tied_pp", "mistral", weights=False, tie_word_embeddings=True)),
        (["--parallelism.tensor_parallel_degree", "2"], "parallelism.tensor_parallel_degree", "ties its input",
         hf_folder(tmp_path / "tied", "mistral", weights=False, tie_word_embeddings=True)),
        (["--parallelism.tensor_parallel_degree", "2"], "parallelism.expert_parallel_degree", "packed expert",
         hf_folder(tmp_path / "moe", "mixtral", weights=False)),
        (["--parallelism.tensor_parallel_degree", "4"], "parallelism.tensor_parallel_degree",
         "4 does not divide model type 'mistral''s num_key_value_heads (2"),
    ]
    for extra, key, says, *where in cases:
        with pytest.raises(ConfigError) as e:
            job(where[0] if where else folder, 4, *extra)
        assert str(e.value).startswith(f"[{key}]") and says in str(e.value)
        assert "\n" not in str(e.value)
    hybrid = hf_folder(tmp_path / "hybrid", "qwen3_next", weights=False)  # linear attention not swapped
    for extra, key in ((["--parallelism.context_parallel_degree", "2"], "parallelism.context_parallel_degree"),
                       (["--model.attention_mask", "block_causal"], "model.attention_mask")):
        with pytest.raises(ConfigError, match=rf"^\[{key}\] model type 'qwen3_next': its linear-attention layers "
                                              r"\(Qwen3NextGatedDeltaNet\) carry a state"):
            job(hybrid, 2, *extra)
    job(hf_folder(tmp_path / "q35", "qwen3_5", weights=False), 2, "--parallelism.context_parallel_degree", "2")
    plan = {**transformers.MistralConfig.base_model_tp_plan, "layers.*.mlp.down_proj": "local_params"}
    monkeypatch.setattr(transformers.MistralConfig, "base_model_tp_plan", plan)
    with pytest.raises(ConfigError, match=r"^\[parallelism.tensor_parallel_degree\] model type 'mistral': its "
                                          r"tensor-parallel plan entry 'layers.\*.mlp.down_proj': 'local_params'"):
        job(folder, 2, "--parallelism.tensor_parallel_degree", "2")
    from torchtrain.models.transformers import attention as tt_attention
    from torchtrain.models.transformers import parallelize as tt_parallelize

    for where in (tt_attention, tt_parallelize):  # a model whose attention does not go through the registry
        monkeypatch.setattr(where, "uses_registry", lambda cls: False)
    with pytest.raises(ConfigError, match=r"^\[parallelism.context_parallel_degree\] model type 'mistral' computes"):
        job(folder, 2, "--parallelism.context_parallel_degree", "2")
    with pytest.raises(ConfigError, match=r"^\[model.attention_mask\] model type 'mistral' computes"):
        job(folder, 1, "--model.attention_mask", "block_causal")


def test_pipeline_stages_compute_the_whole_model(tmp_path):
    """Two stages cut by decoder layers (the first with the embedding, the last with the final norm and head),
    run one after the other, give the whole model's logits; their parameter names are the whole model's."""
    from torchtrain.models.common.parallel import keep_modules
    from torchtrain.models.transformers.pipeline import stage_modules
    from torchtrain.models.transformers.stages import fill_stage

    folder = hf_folder(tmp_path, "qwen2")
    model = ours(folder)
    stages = [keep_modules(model, names) for names in stage_modules(model, 2)]
    for stage in stages:
        fill_stage(stage)
    assert {n for s in stages for n in s.state_dict()} == set(model.state_dict())
    assert "model.layers.1.mlp.up_proj.weight" in stages[1].state_dict()
    with torch.no_grad():
        assert (stages[1](stages[0](tokens())) - model(tokens())).abs().max().item() <= TOL
    job(folder, 2, "--parallelism.pipeline_parallel_degree", "2")  # the launch check accepts it


def test_inputs_that_cannot_work_are_one_config_error(tmp_path):
    folder = hf_folder(tmp_path / "m", "mistral", weights=False)
    small = hf_folder(tmp_path / "small", "mistral", weights=False, vocab_size=200)
    with pytest.raises(ConfigError, match=r"^\[model.hf_assets_path\] the tokenizer's ids \(vocabulary of 258\) do "
                                          r"not fit the model's vocabulary \(200"):
        job(small, 1)
    with pytest.raises(ConfigError, match=r"^\[model.hf_path\] is required"):
        check(["--nproc-per-node", "1", "--nnodes", "1", "--model.name", "transformers"])
    with pytest.raises(ConfigError, match=r"^\[model.hf_path\] '.*' holds no config.json"):
        job(str(tmp_path), 1)
    with pytest.raises(ConfigError, match=r"^\[model.flavor\] transformers has no flavors"):
        job(folder, 1, "--model.flavor", "8B")
    remote = hf_folder(tmp_path / "remote", "mistral", weights=False)
    with open(os.path.join(remote, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(remote, "config.json"), "w") as f:
        json.dump({**raw, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, f)
    with pytest.raises(ConfigError, match=r"^\[model.hf_path\] .* asks for code from the model folder"):
        job(remote, 1)


def test_the_folders_tokenizer_and_weights_are_the_defaults_and_chat_packs_block_causal(tmp_path):
    folder = hf_folder(tmp_path / "m", "mistral", tokenizer=True)
    cfg = parse_args(["--model.name", "transformers", "--model.hf_path", folder, "--training.dataset", "chat",
                      "--training.dataset_path", str(tmp_path / "chat.jsonl")])
    assert cfg.model.hf_assets_path == folder  # the model's own tokenizer
    resolved = preflight(cfg, 1, "cpu")
    assert resolved.tokenizer.file == os.path.join(folder, "tokenizer.json")
    assert resolved.model_args.attention_mask == "block_causal"  # chat rows pack conversations
    assert any("defaults to \"block_causal\"" in text for _, text in cfg.job.notices)
    assert SPEC.hf_weights(resolved.model_args) == folder  # the initial load
    assert SPEC.hf_weights(build_model_args(SPEC, "debugmodel", {"hf_path": hf_folder(tmp_path / "c", "mistral",
                                                                                         weights=False)})) is None
    own = parse_args(["--model.name", "transformers", "--model.hf_path", folder, "--model.hf_assets_path", "x.json"])
    assert own.model.hf_assets_path == "x.json"  # the job's own tokenizer wins


@pytest.mark.parametrize("kind, ep", [("olmo2", 1), ("mixtral", 2)])
def test_declared_collectives_match_the_dry_run(kind, ep, tmp_path):
    """The planner's view (tests/test_contract.py's check): per block and step, each collective's count
    exact and its bytes within 5%, under TP 2 (OLMo 2's plan gathers its q/k/v outputs and cuts o_proj's
    input; Mixtral's MoE blocks run as the engine's layer under EP 2)."""
    from collections import Counter

    from test_contract import BATCH, DTYPES, OPS, SEQ

    from torchtrain.models.contract import declare
    from torchtrain.simulation.dry_run import run_rank

    folder = hf_folder(tmp_path, kind, weights=False)

    def logged(layers: int) -> tuple[Counter, Counter]:
        argv = ["--model.name", "transformers", "--model.hf_path", folder, "--model.n_layers", str(layers),
                "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
                "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", str(ep),
                "--parallelism.data_parallel_shard_degree", "1"]
        counts, sizes = Counter(), Counter()
        for c in run_rank(argv, 2, 0, "cuda", steps=1).collectives:
            n = 1
            for s in c.shapes[0]:
                n *= s
            counts[OPS[c.op]] += 1
            sizes[OPS[c.op]] += n * DTYPES[c.dtype] * (2 if OPS[c.op] == "all_gather" else 1)
        return counts, sizes

    (c1, b1), (c2, b2) = logged(1), logged(2)
    count = {k: c2[k] - c1[k] for k in c2 if c2[k] - c1[k]}
    contract = declare(build_model_args(SPEC, "debugmodel", {"hf_path": folder, "n_layers": 2}))
    block = contract.moe_block if contract.is_moe_layer(1) else contract.dense
    declared_count, declared_size = Counter(), Counter()
    for c in block.collectives(2, 1, ep, contract.attention):
        declared_count[c.kind] += c.count
        declared_size[c.kind] += c.count * c.nbytes(BATCH * SEQ, BATCH, 2)
    assert count == dict(declared_count)
    for kind_, logged_bytes in ((k, b2[k] - b1[k]) for k in count):
        assert declared_size[kind_] == pytest.approx(logged_bytes, rel=0.05), kind_


def test_the_planner_plans_a_transformers_folder(tmp_path):
    """Parameters from the config, the plan it declares, traced memory of one real step on fake tensors."""
    from torchtrain.planner.core import load_job, plan_from_flags

    folder = hf_folder(tmp_path, "mistral", weights=False)
    job = load_job(["--model.name", "transformers", "--model.hf_path", folder, "--training.seq_len", "32",
                    "--training.local_batch_size", "2"])
    plan = plan_from_flags(job, 4, "h100", {"tp": 2})
    assert plan.valid and not plan.blockers and plan.fits
    assert plan.inputs.model.num_params == sum(p.numel() for p in ours(folder, load=False).parameters())
    assert plan.ranks[0].trace is not None and plan.ranks[0].traced_peak is not None
    assert plan.throughput.tokens_per_s > 0
    refused = plan_from_flags(job, 4, "h100", {"pp": 2})
    assert any("pipeline_parallel_degree" in p for p in refused.problems)
