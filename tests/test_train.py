"""A bad job under torchrun fails before the process group, with one line. (The default job through run_train.sh,
its loss, metrics, TensorBoard events and saved config: README's quickstart, run by tests/test_doc_commands.py.)"""

from __future__ import annotations

import pytest
from conftest import assert_no_trainer_traceback, run_train


@pytest.mark.dist
def test_config_error_before_process_group(tmp_path, tiny_job):
    out = run_train(tiny_job + ["--parallelism.data_parallel_shard_degree", "3"], nproc=2, timeout=120)
    assert out.returncode != 0
    assert "config error: [parallelism] degrees multiply to 3" in out.stderr
    # the trainer exits with a message, not a traceback (torchrun then reports the failed child itself)
    assert out.stderr.count("config error") == 1
    assert_no_trainer_traceback(out.stderr)
