"""Coming from torchtitan: its v0.2.2 job files (tests/fixtures/torchtitan_v0.2.2, kept with torchtitan's
BSD-3 licence) read unchanged, its DCP checkpoints (0.2.x and 0.3.x naming) loaded as initial weights
(and optimizer + step), torchtrain checkpoints written back in its layout, and Hugging Face datasets
prepared and trained on.

Tolerances: a torchtitan checkpoint holds the same tensors under other names, so loading it (also
resharded under FSDP 2 x EP 2) gives bitwise the source weights, and the loaded model's logits equal
the source model's (max |difference| <= 1e-5 is asserted; it is 0). A run continued from a torchtitan
checkpoint with its optimizer state gives bitwise the losses of torchtrain's own resume with the same
data position. Prepared shards are compared byte for byte.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, TINY_JOB, assert_no_traceback, read_metrics, run_train
from test_checkpoint import load_all

FIXTURES = os.path.join(REPO, "tests", "fixtures", "torchtitan_v0.2.2")
FILES = sorted(glob.glob(os.path.join(FIXTURES, "*.toml")))
DEBUG_FILES = ["base_config", "llama3__debug_model", "qwen3__qwen3_moe_debug", "deepseek_v3__debug_model"]
C4_FILES = ["llama3__llama3_8b", "llama3__llama3_70b", "llama3__llama3_405b", "qwen3__qwen3_0.6b",
            "qwen3__qwen3_1.7b", "qwen3__qwen3_32b", "deepseek_v3__deepseek_v3_16b", "deepseek_v3__deepseek_v3_671b"]
OTHER_MODELS = {"flux__debug_model": "flux", "flux__flux_dev_model": "flux", "flux__flux_schnell_model": "flux",
                "gpt_oss__debug_model": "gpt_oss", "llama4__debug_model": "llama4",
                "llama4__llama4_17bx128e": "llama4", "llama4__llama4_17bx16e": "llama4"}


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, f"{name}.toml")


def test_the_fixtures_are_torchtitans_shipped_files():
    names = {os.path.basename(f)[:-5] for f in FILES}
    assert names == {*DEBUG_FILES, *C4_FILES, *OTHER_MODELS, "llama3_ft__debug_model"}
    assert open(os.path.join(FIXTURES, "LICENSE")).read().startswith("BSD 3-Clause License")


# ---------------------------------------------------------------------------------------------- job files
@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.basename(p)[:-5])
def test_every_key_of_every_shipped_job_file_is_accepted(path):
    from torchtrain.config import ConfigError, parse_args

    name = os.path.basename(path)[:-5]
    extra = []
    if name == "llama3_ft__debug_model":  # torchtitan launches each replica group with these two
        with pytest.raises(ConfigError, match=r"--fault_tolerance.group_size"):
            parse_args(["--job.config_file", path])
        extra = ["--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1"]
    cfg = parse_args(["--job.config_file", path, *extra])
    texts = [t for _, t in cfg.job.notices]
    assert len(texts) == len(set(texts))  # each adapted key said once
    raw = open(path).read()
    if "disable_color_printing" in raw:
        assert any("metrics.disable_color_printing" in t for t in texts)
    if name == "qwen3__qwen3_moe_debug":
        assert (cfg.model.name, cfg.model.flavor) == ("qwen3_moe", "debugmodel")
    if re.search(r"expert_tensor_parallel_degree = 8", raw):
        assert any("expert_tensor_parallel_degree = 8" in t and "same math" in t for t in texts)
    if name == "llama3_ft__debug_model":
        f = cfg.fault
        assert (f.replica_ft, f.replica_id, f.replica_timeout_s, cfg.parallelism.data_parallel_replicate_degree) == \
            (True, 1, 10.0, 2)
        assert f.hang_timeout_s < cfg.comm.train_timeout_seconds == 15  # fits torchtitan's 15 s collective timeout
        assert any("diloco" in t and "math differs" in t for t in texts)
    if name.startswith("flux"):
        assert any("[encoder]" in t for t in texts) and any("training.img_size" in t for t in texts)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A working folder with what torchtitan's job files point at: a tokenizer (./tests/assets/tokenizer and
    ./assets/hf/<model>) and a c4_test sample (./tests/assets/c4_test/data.json, JSON Lines)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("titan_work")
    words = ["model", "train", "layer", "token", "shard", "batch", "gradient", "the", "of", "and", "a", "to"]
    docs = [" ".join(words[(i * 7 + j * j) % len(words)] for j in range(40 + i % 50)) + f" {i}." for i in range(300)]
    (root / "tests/assets/c4_test").mkdir(parents=True)
    with open(root / "tests/assets/c4_test/data.json", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{i}"}) + "\n")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>",
                                                                                        "<|end_of_text|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    targets = ["tests/assets/tokenizer"] + sorted({m for f in FILES for m in re.findall(r'"\./(assets/hf/[^"]+)"',
                                                                                        open(f).read())})
    for target in targets:
        (root / target).mkdir(parents=True, exist_ok=True)
        tok.save(str(root / target / "tokenizer.json"))
    return root


def test_launch_check_fails_only_for_what_is_not_on_this_machine(stand_in, tmp_path, monkeypatch):
    """Without the files a job names, each language-model job stops at its tokenizer path, one line; with
    them, the debug jobs pass and the others stop only at C4 (not in this machine's HF cache). Layouts are
    checked for CUDA at 64 GPUs (the 405B job uses async TP and float8), so nothing else stands in the way."""
    from torchtrain.config import ConfigError, parse_args
    from torchtrain.launch_check import check
    from torchtrain.trainer.preflight import check_job

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # nothing here
    for name in DEBUG_FILES + C4_FILES:
        with pytest.raises(ConfigError, match=r"\[model.hf_assets_path\] no tokenizer file at '\./"):
            check(["--nproc-per-node", "8", "--job.config_file", fixture(name)])
    for name, model in OTHER_MODELS.items():
        with pytest.raises(ConfigError, match=rf"unknown model '{model}'|no tokenizer file"):
            check(["--nproc-per-node", "8", "--job.config_file", fixture(name)])
    monkeypatch.chdir(stand_in)
    for name in DEBUG_FILES:
        assert check(["--nproc-per-node", "2", "--job.config_file", fixture(name)]) == 2
    for name in C4_FILES:
        cfg = parse_args(["--job.config_file", fixture(name)])
        with pytest.raises(ConfigError, match=r"\[training.dataset\] Hugging Face dataset 'allenai/c4' \(config en, "
                                              r"split 'train'\) is not available here"):
            check_job(cfg, 64, "cuda")


def test_launch_check_line_for_c4_is_one_line_without_traceback(stand_in):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)  # keeps added packages
    out = subprocess.run([sys.executable, "-m", "torchtrain.launch_check", "--nproc-per-node", "1", "--job.config_file",
                          fixture("qwen3__qwen3_0.6b")], cwd=stand_in, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "allenai/c4" in lines[0] and "dataset_path" in lines[0], out.stderr
    assert_no_traceback(out.stderr)


@pytest.mark.parametrize("name", DEBUG_FILES)
def test_debug_job_files_train_on_cpu(stand_in, name):
    """Unchanged files, shortened on the command line to fit the test budget (2 steps of 2 x 128 tokens)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)  # keeps added packages
    env.pop("RANK", None)
    dump = stand_in / "outputs" / name
    out = subprocess.run([sys.executable, "-m", "torchtrain.train", "--job.config_file", fixture(name),
                          "--training.steps", "2", "--training.seq_len", "128", "--training.local_batch_size", "2",
                          "--job.dump_folder", str(dump)],
                         cwd=stand_in, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "training done: 2 steps" in text
    assert text.count("torchtitan job key: metrics.disable_color_printing") == (name != "qwen3__qwen3_moe_debug")
    assert [r["step"] for r in read_metrics(str(dump))] == [1, 2]


# ---------------------------------------------------------------------------------------------- checkpoints
def titan_name(key: str, version: str) -> str:
    """torchtitan's parameter names, as its state-dict adapters list them (v0.2.2 and main, 0.3 naming),
    written independently of torchtrain's adapters."""
    moe = re.match(r"(layers\.\d+\.)feed_forward\.(router\.weight|experts\.w\d|expert_bias|shared_experts\..*)$", key)
    if moe:
        layer, name = moe.groups()
        table = {"router.weight": "router.gate.weight"}
        if version == "0.3":
            table.update({"experts.w1": "routed_experts.inner_experts.w1_EFD",
                          "experts.w2": "routed_experts.inner_experts.w2_EDF",
                          "experts.w3": "routed_experts.inner_experts.w3_EFD", "expert_bias": "expert_bias_E"})
        return f"{layer}moe.{table.get(name, name)}"
    if version == "0.3":
        key = re.sub(r"attention\.(w[qkv])\.weight$", r"attention.qkv_linear.\1.weight", key)
        key = "lm_head.weight" if key == "output.weight" else key
    return key


def build(args: list[str], seed: int = 7):
    from torchtrain.config import parse_args
    from torchtrain.data.tokenizer import build_tokenizer
    from torchtrain.distributed.param_init import init_model_weights
    from torchtrain.models.registry import build_model_args, get_model_spec

    cfg = parse_args(list(args))
    spec = get_model_spec(cfg.model.name)
    margs = build_model_args(spec, cfg.model.flavor, cfg.model.overrides)
    margs.update_from_job(cfg.training.seq_len, build_tokenizer(None))
    model = spec.model_cls(margs)
    init_model_weights(model, seed)
    return model


def logits(model, state: dict[str, torch.Tensor]) -> torch.Tensor:
    model.load_state_dict(state, strict=False)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens)


TINY_DEEPSEEK = ["--model.name", "deepseek_v3", "--model.dim", "64", "--model.n_layers", "3", "--model.n_heads", "4",
                 "--model.vocab_size", "512", "--model.hidden_dim", "128", "--model.moe_intermediate_size", "32",
                 "--training.seq_len", "64"]


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_every_adapter_names_its_parameters_as_torchtitan_does(family):
    from torchtrain.models.registry import get_model_spec

    args = {"deepseek_v3": TINY_DEEPSEEK, "qwen3_moe": TINY_QWEN3_MOE}.get(family, ["--model.name", family])
    model = build(args)
    adapter = get_model_spec(family).state_dict_adapter(model.args)
    keys = list(model.state_dict())
    assert any("feed_forward.experts" in k for k in keys) == (family in ("qwen3_moe", "deepseek_v3"))
    for version in ("0.2", "0.3"):
        for key in keys:
            assert adapter.torchtitan_key(key, version) == titan_name(key, version), (family, version, key)


TINY_QWEN3_MOE = ["--model.name", "qwen3_moe", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "8",
                  "--model.n_kv_heads", "4", "--model.head_dim", "16", "--model.vocab_size", "512",
                  "--model.num_experts", "8", "--model.num_experts_per_tok", "2", "--model.moe_intermediate_size", "32",
                  "--model.moe_load_balance_coeff", "0.01", "--training.dataset", "synthetic", "--training.seq_len",
                  "64", "--training.local_batch_size", "2", "--job.print_config", "false",
                  "--metrics.enable_tensorboard", "false"]


@pytest.mark.dist
@pytest.mark.parametrize("version", ["0.2", "0.3"])
def test_torchtitan_moe_checkpoint_loads_under_fsdp2_ep2_exactly(tmp_path, version):
    """A checkpoint in torchtitan's layout (written here from torchtitan's names), the initial weights of
    a seed checkpoint made under FSDP 2 x EP 2; the source model's weights and logits come back exactly."""
    model = build(TINY_QWEN3_MOE)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    titan = {titan_name(k, version): v for k, v in source.items()}
    assert ("layers.0.moe.routed_experts.inner_experts.w1_EFD" if version == "0.3" else "layers.0.moe.experts.w1") in titan
    dcp.save(titan, checkpoint_id=str(tmp_path / "titan" / "step-30"), no_dist=True)
    out = run_train([*TINY_QWEN3_MOE, "--parallelism.expert_parallel_degree", "2", "--checkpoint.enable",
                     "--checkpoint.create_seed_checkpoint", "--checkpoint.initial_load_path", str(tmp_path / "titan"),
                     "--job.dump_folder", str(tmp_path / "run")], nproc=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"is a torchtitan {version} checkpoint" in out.stdout
    loaded = load_all(str(tmp_path / "run" / "checkpoint" / "step-0"))
    weights = {k[len("model."):]: v for k, v in loaded.items() if k.startswith("model.")}
    assert weights.keys() == source.keys()
    for k, v in source.items():
        assert torch.equal(weights[k], v), k
    fresh = build(TINY_QWEN3_MOE, seed=99)
    diff = (logits(fresh, weights) - logits(model, source)).abs().max().item()
    assert diff <= 1e-5, diff


TINY_RUN = [*TINY_JOB, "--metrics.log_freq", "1", "--debug.deterministic", "--metrics.enable_tensorboard", "false",
            "--checkpoint.enable", "--checkpoint.interval", "4"]


@pytest.mark.slow
def test_a_run_continues_from_a_torchtitan_checkpoint_and_goes_back(tmp_path):
    """torchtrain step-4 -> scripts/convert_to_torchtitan.py (with optimizer) -> initial load of model, optimizer
    and step: steps 5..8 equal torchtrain's own resume that restarts the data (torchtitan's loader state is
    not read); the script writes torchtitan's names."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import convert_to_torchtitan
    from torch.distributed.checkpoint import FileSystemReader

    src = tmp_path / "src"
    assert run_train([*TINY_RUN, "--training.steps", "4", "--job.dump_folder", str(src)]).returncode == 0
    for version in ("0.2", "0.3"):
        out = tmp_path / f"titan{version}" / "step-4"
        assert convert_to_torchtitan.main([str(src / "checkpoint"), str(out), "--version", version,
                                           "--with-optimizer"]) == 0
        keys = set(FileSystemReader(str(out)).read_metadata().state_dict_metadata)
        head = "lm_head.weight" if version == "0.3" else "output.weight"
        wq = titan_name("layers.0.attention.wq.weight", version)
        assert {head, wq, "tok_embeddings.weight", "train_state.step", "train_state.ntokens_seen",
                f"optimizer.state.{wq}.exp_avg"} <= keys
        assert not any(k.startswith(("model.", "dataloader.", "rng.")) for k in keys)
    assert convert_to_torchtitan.main([str(src / "checkpoint"), str(tmp_path / "titan0.2" / "step-4")]) == 2
    own = tmp_path / "own"
    shutil.copytree(src / "checkpoint" / "step-4", own / "checkpoint" / "step-4")
    runs = {"own": run_train([*TINY_RUN, "--training.steps", "8", "--checkpoint.exclude_from_loading", "dataloader,rng",
                              "--job.dump_folder", str(own)])}
    for version in ("0.2", "0.3"):
        runs[version] = run_train([*TINY_RUN, "--training.steps", "8", "--checkpoint.initial_load_model_only", "false",
                                   "--checkpoint.initial_load_path", str(tmp_path / f"titan{version}"),
                                   "--job.dump_folder", str(tmp_path / f"run{version}")])
    for name, out in runs.items():
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "initial load of model, optimizer, lr_scheduler, train_state" in runs["0.3"].stdout
    expected = {r["step"]: r["loss"] for r in read_metrics(str(own))}
    assert sorted(expected) == [5, 6, 7, 8]
    for version in ("0.2", "0.3"):
        assert {r["step"]: r["loss"] for r in read_metrics(str(tmp_path / f"run{version}"))} == expected


# ---------------------------------------------------------------------------------------------- HF datasets
@pytest.fixture(scope="module")
def hf_rows(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hf_data")
    rows = [{"text": f"document {i}: " + "alpha beta gamma " * (i % 23), "id": i} for i in range(2000)]
    with open(root / "rows.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (root / "repo").mkdir()  # a dataset repository as the Hub would hold it, loaded by `datasets` into its cache
    shutil.copy(root / "rows.jsonl", root / "repo" / "train.jsonl")
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(root / "saved"), max_shard_size="30KB")  # several Arrow files
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(50))}).save_to_disk(str(root / "dict"))
    return root


def prepare(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtrain.data.prepare", *args], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, **(env or {})))


def shard_bytes(folder) -> dict[str, bytes]:
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(str(folder), "*.bin")))
            + sorted(glob.glob(os.path.join(str(folder), "*.idx")))}


@pytest.mark.slow
def test_an_hf_dataset_prepares_into_the_shards_of_the_same_rows_as_jsonl(hf_rows, tmp_path):
    root = hf_rows
    assert len(glob.glob(str(root / "saved" / "*.arrow"))) > 2
    runs = {"jsonl": [str(root / "rows.jsonl")], "saved": [str(root / "saved")], "dict": [str(root / "dict")],
            "cache": ["--hf", str(root / "repo")]}  # through `datasets` and its cache (Arrow files)
    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1"}
    for name, inputs in runs.items():
        out = prepare(*inputs, "--out", str(tmp_path / name), env=env)
        assert out.returncode == 0, out.stderr[-3000:]
    expected = shard_bytes(tmp_path / "jsonl")
    assert expected and all(shard_bytes(tmp_path / name) == expected for name in runs)
    # any worker count: byte-identical shards (several Arrow files, small shards)
    for workers in ("1", "2"):
        out = prepare(str(root / "saved"), "--out", str(tmp_path / f"w{workers}"), "--workers", workers,
                      "--shard-size-mb", "0.02")
        assert out.returncode == 0, out.stderr[-3000:]
    assert len(shard_bytes(tmp_path / "w1")) > 4 and shard_bytes(tmp_path / "w1") == shard_bytes(tmp_path / "w2")
    out = prepare(str(root / "dict"), "--split", "test", "--out", str(tmp_path / "none"))
    assert out.returncode == 2 and "has no 'test' split" in out.stderr and "splits train, validation" in out.stderr
    out = prepare("--hf", "allenai/c4:en", "--out", str(tmp_path / "none"), env=env)
    assert out.returncode == 2 and "not available here" in out.stderr and "INPUT" in out.stderr
    assert_no_traceback(out.stderr)
    assert not os.path.exists(tmp_path / "none" / "manifest.json")


def test_training_reads_an_hf_dataset_directly(hf_rows, tmp_path):
    out = run_train([*TINY_JOB, "--training.dataset", "hf", "--training.dataset_path", str(hf_rows / "dict"),
                     "--training.steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
                     "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
                     "--job.dump_folder", str(tmp_path)])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "preparing hf-train" in out.stdout and "preparing hf-validation" in out.stdout
    assert [r["step"] for r in read_metrics(str(tmp_path)) if "loss" in r] == [1, 2]
