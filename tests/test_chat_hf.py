"""Chat data from Hugging Face datasets (no hub access): a `save_to_disk` folder (a Dataset, or a
DatasetDict's train split) and its Arrow or Parquet files give the same conversations as the JSON
Lines file of the same records; a bad row is one line naming the file and row; such a folder mixes
with JSON Lines files and passes the launch check."""

from __future__ import annotations

import pytest
from test_chat import GOOD, JOB, write_jsonl

from torchtrain.config import ConfigError
from torchtrain.data.chat.records import read_conversations
from torchtrain.launch_check import check

datasets = pytest.importorskip("datasets", reason="datasets not installed (pip install -e .[dev])")

RECORDS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4."}]},
    GOOD,
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
]
FLAT = [{"prompt": "p", "response": "r"}, {"prompt": "q", "response": "s", "system": "sys"}]


def turns(path: str) -> list:
    return [c.turns for c in read_conversations(path)]


def test_saved_datasets_and_their_files_read_like_json_lines(tmp_path):
    expected = turns(write_jsonl(tmp_path / "chat.jsonl", RECORDS))
    ds = datasets.Dataset.from_list(RECORDS)
    ds.save_to_disk(str(tmp_path / "saved"))
    assert turns(str(tmp_path / "saved")) == expected
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert turns(str(tmp_path / "dict")) == expected  # the train split
    assert turns(str(tmp_path / "dict" / "test")) == expected[:1]
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    assert turns(str(tmp_path / "chat.parquet")) == expected
    # flat shapes: a row without a column's value (None in Arrow) is a record without that key
    columns = {k: [r.get(k) for r in FLAT] for k in ("prompt", "response", "system")}
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "flat"))
    assert turns(str(tmp_path / "flat")) == turns(write_jsonl(tmp_path / "flat.jsonl", FLAT))


def test_a_saved_dataset_mixes_with_json_lines_and_bad_rows_name_file_and_row(tmp_path):
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
    jsonl = write_jsonl(tmp_path / "chat.jsonl", RECORDS)
    assert check(["--nproc-per-node", "1", *JOB, "--training.datasets", f"{tmp_path / 'saved'}:0.5,{jsonl}:0.5"]) == 1
    bad = RECORDS + [{"messages": [{"role": "user", "content": "no answer"}]}]
    datasets.Dataset.from_list(bad).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ConfigError) as e:
        check(["--nproc-per-node", "1", *JOB, "--training.dataset_path", str(tmp_path / "bad")])
    message = str(e.value)
    assert message.startswith("[training.dataset_path]") and "\n" not in message
    assert ".arrow:row 4: the conversation has no assistant turn" in message
