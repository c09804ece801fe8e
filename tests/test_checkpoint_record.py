"""What a checkpoint records of its model is what its readers rebuild (`models/registry.py::model_record` /
`model_from_record`): the family, the flavor, the class of its arguments and every argument.

* every registered flavor's record, through JSON, rebuilds equal arguments of the same class (a dense Qwen3.5 stays
  dense: the family's registered class is the MoE one), also from a record written before the class was recorded;
* a dense Qwen3.5, text and vision-language, imported from a transformers folder (`scripts/convert_hf_to_dcp.py`),
  exported back (`scripts/convert_dcp_to_hf.py`, the model from the checkpoint's record alone) loads into
  transformers with no missing and no unexpected key, logits within 1e-5 (fp32; the tolerance of
  tests/test_qwen3_5.py and its reasons), and the context length the imported config.json declared (256, where the
  job trained at 44);
* `python -m torchtrain.generate` reads a checkpoint copied away from its job folder (model and tokenizer from the
  record).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from conftest import REPO

from torchtrain.models.registry import args_differences, get_model_spec, model_from_record, model_names, model_record

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_every_flavor_rebuilds_from_its_record():
    for name in model_names():
        spec = get_model_spec(name)
        for flavor, args in spec.flavors.items():
            record = json.loads(json.dumps(model_record(name, flavor, args)))
            for saved in (record, {k: v for k, v in record.items() if k != "kind"}):
                _, again = model_from_record(saved)
                assert type(again) is type(args) and again == args, (name, flavor)
                assert args_differences(saved["args"], again) == {}


def test_a_dense_qwen3_5_record_is_not_rebuilt_as_the_families_moe_class():
    spec = get_model_spec("qwen3_5")
    args = spec.flavors["debugmodel"].replace(n_layers=2)
    assert type(args) is not spec.args_cls  # the registered class is the MoE one
    _, again = model_from_record(json.loads(json.dumps(model_record("qwen3_5", "debugmodel", args))))
    assert type(again).__name__ == "Qwen3_5Args" and again.n_layers == 2


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def keys(**kwargs) -> list[str]:
    return [a for k, v in kwargs.items() for a in (f"--model.{k}", ",".join(map(str, v)) if isinstance(v, (tuple, list))
                                                  else str(v))]


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vision"])
def test_dense_qwen3_5_imports_and_exports_exactly(tmp_path, vision):
    transformers = pytest.importorskip("transformers")
    if vision:
        import test_qwen3_5_vl as case
        text = dict(case.TEXT, **case.VISION)
        hf = case.hf_model("dense")
        hf.config.text_config.max_position_embeddings = 256
        b = case.batch()

        def logits(model):
            return case.hf_logits(model, b)
    else:
        import test_qwen3_5 as case
        text = dict(case.SHAPE)
        hf = case.hf_model("dense")
        hf.config.max_position_embeddings = 256
        ids = case.tokens()

        def logits(model):
            with torch.no_grad():
                return model(ids).logits
    text.pop("max_seq_len")
    hf.save_pretrained(tmp_path / "hf")
    job = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel", "--training.seq_len", "44", *keys(**text)]
    assert script("convert_hf_to_dcp")([str(tmp_path / "hf"), str(tmp_path / "dcp"), *job]) == 0
    with open(tmp_path / "dcp" / "complete.json") as f:
        record = json.load(f)["model"]
    assert record["kind"] == "Qwen3_5Args" and record["args"]["context_length"] == 256

    assert script("convert_dcp_to_hf")([str(tmp_path / "dcp"), str(tmp_path / "out")]) == 0  # the record alone
    with open(tmp_path / "out" / "config.json") as f:
        config = json.load(f)
    assert (config["text_config"] if vision else config)["max_position_embeddings"] == 256
    cls = getattr(transformers, config["architectures"][0])
    assert "Moe" not in cls.__name__
    back, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = logits(hf)
    assert ref.abs().max() > 0.5 and (logits(back.float().eval()) - ref).abs().max().item() <= 1e-5


def test_generate_reads_a_checkpoint_copied_away_from_its_job(tmp_path, capsys):
    pytest.importorskip("transformers")
    import test_qwen3_5 as case

    from torchtrain.generate import main

    text = dict(case.SHAPE)
    text.pop("max_seq_len")
    case.hf_model("dense").save_pretrained(tmp_path / "hf")
    job = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel", "--training.seq_len", "44", *keys(**text)]
    assert script("convert_hf_to_dcp")([str(tmp_path / "hf"), str(tmp_path / "job" / "step-0"), *job]) == 0
    shutil.copytree(tmp_path / "job" / "step-0", tmp_path / "elsewhere" / "step-0")
    shutil.rmtree(tmp_path / "job")
    assert main(["--checkpoint", str(tmp_path / "elsewhere"), "--prompt", "ab", "--max-new-tokens", "3",
                 "--temperature", "0"]) == 0
    assert "model from the checkpoint's complete.json" in capsys.readouterr().err
