"""Config parsing: precedence, override syntax, --help, and every kind of bad input."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from conftest import REPO, assert_no_traceback

from torchtrain.config import ConfigError, JobConfig, format_help, job_value, parse_args, to_toml
from torchtrain.config.fields import field_docs, field_types
from torchtrain.config.manager import _sections, tables
from torchtrain.data.tokenizer import build_tokenizer
from torchtrain.distributed.layout import resolve_batch
from torchtrain.distributed.parallel_dims import ParallelDims
from torchtrain.models.registry import build_model_args, get_model_spec, model_arguments
from torchtrain.trainer.preflight import preflight, resolve_model


def write(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_parse():
    cfg = parse_args([])
    assert isinstance(cfg, JobConfig)
    assert cfg.training.steps == 10000 and cfg.parallelism.data_parallel_shard_degree == -1


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 0.01\n")
    cfg = parse_args(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 128  # TOML beats default
    assert cfg.optimizer.lr == 0.01
    assert cfg.training.local_batch_size == 8  # default


def test_override_syntaxes():
    cfg = parse_args(["--training.steps=3", "--optimizer.lr", "1e-3", "--debug.deterministic",
                      "--metrics.enable_tensorboard", "false", "--lr_scheduler.decay_ratio", "0.2"])
    assert cfg.training.steps == 3 and cfg.optimizer.lr == 1e-3
    assert cfg.debug.deterministic is True  # bare boolean flag
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.lr_scheduler.decay_ratio == 0.2
    assert parse_args(["--lr_scheduler.decay_ratio", "none"]).lr_scheduler.decay_ratio is None
    assert parse_args(["--debug.deterministic", "true"]).debug.deterministic is True


def test_int_accepted_for_float_and_float_type_kept(tmp_path):
    cfg = parse_args(["--job.config_file", write(tmp_path, "[optimizer]\nlr = 1\n")])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


def test_model_overrides(tmp_path):
    path = write(tmp_path, "[model]\nflavor = \"debugmodel\"\ndim = 128\n")
    cfg = parse_args(["--job.config_file", path, "--model.n_layers", "3"])
    assert cfg.model.overrides == {"dim": 128, "n_layers": "3"}  # raw: the model registry types them
    args = build_model_args(get_model_spec("llama3"), cfg.model.flavor, cfg.model.overrides)
    assert args.dim == 128 and args.n_layers == 3 and args.n_heads == 16
    resolve_model(cfg, build_tokenizer(None))
    assert cfg.model.overrides == {"dim": 128, "n_layers": 3}


@pytest.mark.parametrize(
    "argv, toml, expected",
    [
        (["--trainig.steps", "3"], None, "did you mean 'training'"),
        (["--training.stpes", "3"], None, "did you mean 'steps'"),
        (["--model.dimm", "3"], None, "did you mean 'dim'"),
        (["--training.steps", "ten"], None, "[training.steps] expects an integer"),
        (["--training.steps", "0"], None, "[training.steps] must be >= 1"),
        (["--optimizer.lr", "-1"], None, "[optimizer.lr] must be > 0"),
        (["--optimizer.beta2", "1.5"], None, "[optimizer.beta2] must be <= 1"),
        (["--lr_scheduler.decay_type", "exp"], None, "[lr_scheduler.decay_type] must be one of"),
        (["--debug.deterministic", "maybe"], None, "expects a boolean"),
        (["--job.config_file", "/nonexistent/job.toml"], None, "[job.config_file] file not found"),
        ([], "[training]\nsteps = \"ten\"\n", "[training.steps] expects an integer"),
        ([], "[training]\nsteps = true\n", "[training.steps] expects an integer"),
        ([], "[training]\nsteps = 5\n[bogus]\nx = 1\n", "unknown config section [bogus]"),
        ([], "steps = 5\n", "not a [section] table"),
        ([], "[training\nsteps = 5\n", "not valid TOML"),
        (["steps"], None, "unexpected argument"),
        (["--steps", "3"], None, "expected --section.key"),
        (["--training.steps"], None, "needs a value"),
        (["--model.name", "gpt9"], None, "unknown model 'gpt9'"),
        (["--training.dataset", "c5"], None, "unknown dataset 'c5'"),
        (["--training.dataset", "files"], None, "[training.dataset_path] is required"),
        (["--parallelism.data_parallel_shard_degree", "0"], None, "data_parallel_shard_degree] must be -1"),
    ],
)
def test_bad_input_names_the_key(tmp_path, argv, toml, expected):
    """Parsing, then the trainer's pre-start checks (model arguments and dataset names are known there)."""
    if toml is not None:
        argv = ["--job.config_file", write(tmp_path, toml)] + argv
    with pytest.raises(ConfigError) as err:
        preflight(parse_args(argv), 1, "cpu")
    assert expected in str(err.value)


def test_bad_flavor():
    cfg = parse_args(["--model.flavor", "8b"])
    with pytest.raises(ConfigError, match="did you mean '8B'"):
        build_model_args(get_model_spec("llama3"), cfg.model.flavor, {})


def test_model_arg_consistency():
    spec = get_model_spec("llama3")
    with pytest.raises(ConfigError, match=r"\[model.dim\] 100 is not divisible by model.n_heads 16"):
        build_model_args(spec, "debugmodel", {"dim": 100})
    with pytest.raises(ConfigError, match=r"\[model.n_kv_heads\] 3 must divide model.n_heads 16"):
        build_model_args(spec, "debugmodel", {"n_kv_heads": 3})


@pytest.mark.parametrize(
    "degrees, world, expected",
    [
        ({}, 4, (1, 4)),
        ({"data_parallel_replicate_degree": 2}, 4, (2, 2)),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}, 4, (2, 2)),
    ],
)
def test_parallel_dims_resolution(degrees, world, expected):
    cfg = parse_args([f"--parallelism.{k}={v}" for k, v in degrees.items()])
    pd = ParallelDims.from_config(cfg.parallelism, world)
    assert (pd.dp_replicate, pd.dp_shard) == expected and pd.dp == world


@pytest.mark.parametrize(
    "degrees, world, expected",
    [
        ({"data_parallel_shard_degree": 3}, 4, "degrees multiply to 3"),
        ({"data_parallel_replicate_degree": 3}, 4, "not divisible"),
        ({"tensor_parallel_degree": 3}, 4, "not divisible"),
        ({"pipeline_parallel_degree": 3}, 4, "not divisible"),
    ],
)
def test_parallel_dims_errors(degrees, world, expected):
    cfg = parse_args([f"--parallelism.{k}={v}" for k, v in degrees.items()])
    with pytest.raises(ConfigError, match=expected):
        ParallelDims.from_config(cfg.parallelism, world)


def test_batch_plan():
    plan = resolve_batch(2, 16, dp_degree=2)
    assert (plan.global_batch_size, plan.grad_accum_steps) == (16, 4)
    assert resolve_batch(8, -1, 4).global_batch_size == 32
    with pytest.raises(ConfigError, match="not a multiple"):
        resolve_batch(8, 12, dp_degree=2)


def test_every_field_documented_and_in_help():
    text = format_help([], model_arguments)
    for section, klass in _sections().items():
        for name, cls in tables(section, klass):  # nested tables too, e.g. [quantize.linear.float8]
            docs = field_docs(cls)
            for f in dataclasses.fields(cls):
                if f.metadata.get("internal"):
                    continue
                assert docs.get(f.name), f"{name}.{f.name} has no docstring"
                if not dataclasses.is_dataclass(field_types(cls)[f.name]):
                    assert f"--{name}.{f.name} " in text
    spec = get_model_spec("llama3")
    for f in dataclasses.fields(spec.args_cls):
        assert field_docs(spec.args_cls).get(f.name), f"model.{f.name} has no docstring"
        assert f"--model.{f.name} " in text
    assert "--training.steps  int (>= 1)  (default: 10000)" in text
    assert "one of: linear, sqrt, cosine" in text


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_args(["--training.steps", "11", "--model.dim", "128", "--lr_scheduler.decay_ratio", "0.5",
                      "--job.description", 'say "hi"\n'])
    path = write(tmp_path, to_toml(cfg))
    again = parse_args(["--job.config_file", path])
    cfg.job.config_file = again.job.config_file = None
    assert again == cfg


def test_field_types_cover_all_sections():
    for cls in _sections().values():
        assert field_types(cls)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "torchtrain.train", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_help_and_errors_exit_cleanly():
    out = _cli("--help")
    assert out.returncode == 0 and "--parallelism.data_parallel_shard_degree" in out.stdout
    assert "model arguments of 'llama3'" in out.stdout
    bad = _cli("--training.stepz", "3")
    assert bad.returncode == 2
    assert "config error: unknown key training.stepz" in bad.stderr and "did you mean 'steps'" in bad.stderr
    assert_no_traceback(bad.stderr)


def test_config_reference_doc_is_current():
    sys.path.insert(0, f"{REPO}/scripts")
    from gen_config_reference import render

    with open(f"{REPO}/docs/config_reference.md") as f:
        assert f.read() == render(), "run: python scripts/gen_config_reference.py"


@pytest.mark.parametrize("name, world", [("debug_model", 1), ("llama3_8b", 8), ("llama3_70b", 64),
                                         ("llama3_405b", 512)])
def test_shipped_job_files_are_valid_for_their_cluster(name, world):
    """The GPU jobs pass every pre-start check for the world size their header documents."""
    from torchtrain.trainer.preflight import preflight

    cfg = parse_args(["--job.config_file", f"{REPO}/train_configs/{name}.toml"])
    # (the jobs' HF tokenizer files are not on a CI machine: the byte tokenizer stands in)
    preflight(cfg, world, "cuda" if world > 1 else "cpu", tokenizer=build_tokenizer(None))


def test_help_shows_the_arguments_of_the_jobs_model(monkeypatch):
    """--help reads --model.name (and job.custom_imports, imported first) from the command line."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "plugins"))
    text = format_help(["--help", "--job.custom_imports", "toy_mlp", "--model.name", "toy_mlp"], model_arguments)
    assert "model arguments of 'toy_mlp'" in text
    assert "model arguments of 'llama3'" in format_help(["--help"], model_arguments)


def test_traceback_check_ignores_where_the_checkout_lives():
    """The no-traceback assertions look at traceback frames, not at path substrings: a checkout in a
    folder named `torchtrain` with its virtual environment inside (the README's setup) puts that
    name into torchrun's own frames, which must not count as a trainer traceback."""
    from conftest import PACKAGE_DIR, package_frames

    launcher = (f'Traceback (most recent call last):\n  File "{REPO}/.venv/bin/torchrun", line 8, in <module>\n'
                f'  File "{REPO}/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run\n'
                f'torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n'
                f'torchtrain: config error: [checkpoint] {REPO}/torchtrain/outputs/step-4 is truncated\n')
    assert package_frames(launcher) == []
    trainer = launcher + f'  File "{PACKAGE_DIR}/train.py", line 251, in main\n'
    assert package_frames(trainer) == [f"{PACKAGE_DIR}/train.py"]


def test_job_value_reads_a_resolved_key_or_names_the_wrong_one():
    """`job_value` (what `launch_check --print` prints): a section's key and a nested table's key as resolved; a
    wrong section, key or a table in place of a value is one error naming it and the closest right name."""
    cfg = parse_args(["--training.steps", "7", "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true"])
    assert job_value(cfg, "training.steps") == 7 and job_value(cfg, "fault.sdc_exclude_file") is None
    assert job_value(cfg, "quantize.linear.float8.enable_fsdp_float8_all_gather") is True
    for key, said in (("trainin.steps", "did you mean 'training'"), ("training.step", "did you mean 'steps'"),
                      ("quantize.linear", "a table, not a value"), ("fault", "a table, not a value"),
                      ("training.steps.x", "training.steps has no key 'x'")):
        with pytest.raises(ConfigError, match=said) as err:
            job_value(cfg, key)
        assert str(err.value).startswith(f"{key}: ")
