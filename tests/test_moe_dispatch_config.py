"""Bad expert-parallel communication settings are one-line config errors before launch (preflight:
the resolved Layout's checks), and good ones resolve to the dispatcher's settings."""

from __future__ import annotations

import pytest

from torchtrain.config import ConfigError, parse_args
from torchtrain.distributed.layout import resolve_layout
from torchtrain.trainer.preflight import preflight

MOE = ["--model.name", "qwen3_moe", "--model.num_experts", "8", "--training.seq_len", "64"]
P = "--parallelism."


@pytest.mark.parametrize("argv, world, message", [
    ([f"{P}expert_parallel_comm_backend", "node_limited"], 2, "needs expert_parallel_degree > 1"),
    ([f"{P}expert_parallel_overlap_chunks", "2"], 2, "[parallelism.expert_parallel_overlap_chunks] 2"),
    ([f"{P}expert_parallel_degree", "4", f"{P}expert_parallel_ranks_per_node", "3"], 4,
     "[parallelism.expert_parallel_ranks_per_node] 3"),
    ([f"{P}expert_parallel_degree", "2", f"{P}expert_parallel_overlap_chunks", "65"], 2, "outnumber the 64"),
    (["--model.converters", "quantize.grouped_mm.float8"], 1, "float8 grouped GEMMs"),
    ([f"{P}expert_parallel_degree", "2", f"{P}expert_parallel_overlap_f_b", "true"], 2,
     "[parallelism.expert_parallel_overlap_f_b] overlaps the forward/backward pairs of the DualPipeV schedule"),
    ([f"{P}pipeline_parallel_schedule", "DualPipeV", f"{P}expert_parallel_overlap_f_b", "true"], 2,
     "needs expert_parallel_degree > 1"),
    ([f"{P}pipeline_parallel_schedule", "DualPipeV", f"{P}expert_parallel_degree", "2", f"{P}tensor_parallel_degree",
      "2", f"{P}expert_parallel_overlap_f_b", "true"], 4, "tensor/context-parallel collectives would race"),
    ([f"{P}pipeline_parallel_schedule", "DualPipeV", f"{P}expert_parallel_degree", "2", "--compile.enable",
      f"{P}expert_parallel_overlap_f_b", "true"], 2, "with a compiled model is not supported"),
])
def test_bad_expert_comm_settings_are_config_errors(argv, world, message):
    with pytest.raises(ConfigError) as err:
        preflight(parse_args([*MOE, *argv]), world, "cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_expert_comm_resolves_node_size_chunks_and_delay(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = parse_args([*MOE, f"{P}expert_parallel_degree", "4", f"{P}expert_parallel_comm_backend", "node_limited",
                      f"{P}expert_parallel_overlap_chunks", "4", "--debug.expert_comm_delay_ms", "5"])
    comm = resolve_layout(cfg, 4, "cpu").expert_comm
    assert (comm.backend, comm.ranks_per_node, comm.chunks, comm.delay_ms) == ("node_limited", 2, 4, 5.0)
    assert resolve_layout(parse_args(MOE), 4, "cpu").expert_comm is None
    overlap = parse_args([*MOE, f"{P}expert_parallel_degree", "2", f"{P}pipeline_parallel_schedule", "DualPipeV",
                          f"{P}expert_parallel_overlap_f_b", "true"])
    assert resolve_layout(overlap, 2, "cpu").expert_comm.overlap_f_b
