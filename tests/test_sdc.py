"""Silent data corruption ([fault] sdc_check_freq; components/fault/replica_check.py): the digests and the
comparison on fixed tensors, the keys checked at parse time, and under real torchrun + gloo (one 4-rank
launch, four jobs) a bit flipped in one replica named at the next check, with `rollback` ending bitwise on
the clean run's weights; under pure FSDP (one 2-rank launch, three jobs) a corrupted output of one
micro-batch caught by the re-execution check, which itself changes nothing (bitwise the run without it).

Why bitwise: replicas receive the same all-reduced gradients and apply the same element-wise update, so
they hold equal bits; the rolled-back run restores the step-4 checkpoint (written after a clean check) with
its data position and trains steps 5-8 again on the same data from the same state, as the clean run did.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from conftest import TINY_JOB, read_metrics, run_together
from test_guard import flat, load

from torchtrain.components.fault.replica_check import compare, digest
from torchtrain.config import ConfigError, parse_args


def test_one_flipped_bit_changes_the_digest_and_a_swap_changes_the_weighted_sum():
    x = torch.randn(1000)
    base = digest(x)
    for bit in (0, 10, 22, 31):
        y = x.clone()
        y[123:124].view(torch.int32).bitwise_xor_(1 << bit)
        assert digest(y)[0] != base[0], bit
    swapped = x.clone()
    swapped[[5, 9]] = x[[9, 5]]
    assert digest(swapped)[0] == base[0] and digest(swapped)[1] != base[1]
    assert torch.equal(digest(x.to(torch.bfloat16)), digest(x.to(torch.bfloat16).clone()))
    assert torch.equal(digest(torch.tensor(3.0)), digest(torch.tensor([3.0])))


def test_the_digest_is_the_documented_integer_sums():
    """S and W of the module doc, computed here in Python integers from the tensor's bytes (float32 and bfloat16,
    with and without bytes left over after the last whole word)."""
    def wrap(v: int) -> int:
        return (v + 2**63) % 2**64 - 2**63

    for dtype, n in ((torch.float32, 778), (torch.float32, 777), (torch.bfloat16, 333)):
        x = torch.randn(n).to(dtype)
        data = x.view(torch.uint8).numpy().tobytes()
        whole = len(data) // 8 * 8
        words = [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, whole, 8)]
        tail = [int.from_bytes(data[i:i + 1], "little", signed=True) for i in range(whole, len(data))]
        s = sum(words) + sum(tail)
        w = sum((2 * i + 1) * v for i, v in enumerate(words)) + sum((2 * j + 1) * v for j, v in enumerate(tail))
        assert digest(x).tolist() == [wrap(s), wrap(w)], (dtype, n)


def test_the_odd_replica_out_is_named_and_a_tie_names_both():
    names = ["a", "b"]
    good, bad = [1, 2], [1, 3]
    four = torch.tensor([[good, good], [good, bad], [good, good], [good, good]])
    found = compare(names, four, [0, 2, 4, 6], step=7)
    assert [(m.step, m.tensor, m.ranks) for m in found] == [(7, "b", [2])]
    assert found[0].digests[2] == bad and found[0].digests[0] == good
    two = torch.tensor([[good, good], [good, bad]])
    assert [m.ranks for m in compare(names, two, [1, 3], step=2)] == [[1, 3]]
    assert compare(names, torch.tensor([[good, good]] * 3), [0, 1, 2], step=1) == []


def test_keys_that_cannot_work_are_refused_at_parse_time():
    with pytest.raises(ConfigError, match=r"fault.sdc_policy.*checkpoint.enable"):
        parse_args(["--fault.sdc_check_freq", "10"])
    with pytest.raises(ConfigError, match=r"debug.inject_bitflip_step.*fault.sdc_check_freq"):
        parse_args(["--debug.inject_bitflip_step", "3"])
    assert parse_args(["--fault.sdc_check_freq", "10", "--fault.sdc_policy", "warn"]).fault.sdc_check_freq == 10


STEPS = 8
HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "4",
        "--checkpoint.keep_latest_k", "0"]


def job(dump, *extra: str) -> list[str]:
    return [*TINY_JOB, "--training.steps", str(STEPS), "--training.global_batch_size", "8", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--fault.sdc_check_freq", "2", "--job.dump_folder", str(dump),
            *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch of 4 ranks: HSDP 2 x 2 clean; HSDP with a parameter bit flipped on rank 3 after step 5 (rolled
    back); DDP over 4 with an optimizer-state bit flipped on rank 1 after step 3 (`warn`); last (it ends the
    launch), ZeRO-1 with a parameter flipped on rank 2 after step 2 (`abort`)."""
    work = tmp_path_factory.mktemp("sdc")
    dumps = {name: str(work / name) for name in ("clean", "flipped", "ddp", "abort")}
    argvs = [job(dumps["clean"], *HSDP),
             job(dumps["flipped"], *HSDP, "--debug.inject_bitflip_step", "5", "--debug.inject_bitflip_rank", "3",
                 "--fault.sdc_exclude_file", os.path.join(dumps["flipped"], "exclude.txt")),
             job(dumps["ddp"], "--parallelism.data_parallel_strategy", "ddp", "--fault.sdc_policy", "warn",
                 "--debug.inject_bitflip_step", "3", "--debug.inject_bitflip_rank", "1",
                 "--debug.inject_bitflip_target", "optimizer"),
             job(dumps["abort"], "--parallelism.data_parallel_strategy", "zero1", "--fault.sdc_policy", "abort",
                 "--debug.inject_bitflip_step", "2", "--debug.inject_bitflip_rank", "2")]
    outcomes = run_together(argvs, 4, str(work))
    for (rc, log), name in zip(outcomes, dumps):
        assert (rc != 0) == (name == "abort"), (name, log[-3000:])
    return {name: (dump, log) for (name, dump), (_, log) in zip(dumps.items(), outcomes)}


@pytest.mark.dist
def test_a_flipped_hsdp_parameter_is_named_and_rolled_back_to_the_clean_weights(runs):
    (clean, _), (flipped, log) = runs["clean"], runs["flipped"]
    assert "sdc: after step 6 the data-parallel replicas differ: tok_embeddings.weight on rank(s) 1, 3" in log
    assert "sdc: rolled back from step 6 to step-4" in log
    evidence = os.path.join(flipped, "sdc", "step-6.json")
    assert os.path.exists(evidence) and not os.path.exists(os.path.join(clean, "sdc"))
    host = socket.gethostname()
    assert json.load(open(evidence))["hosts"] == {"1": host, "3": host}
    assert open(os.path.join(flipped, "exclude.txt")).read() == f"{host}\n"  # for the scheduler, once
    records = read_metrics(flipped)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # step 6 logged, then trained again
    last = {r["step"]: r["loss"] for r in records}
    assert last == {r["step"]: r["loss"] for r in read_metrics(clean)}
    assert records[-1]["sdc_mismatches"] == 1
    ours = flat(load(os.path.join(flipped, "checkpoint", f"step-{STEPS}")))
    theirs = flat(load(os.path.join(clean, "checkpoint", f"step-{STEPS}")))
    assert ours.keys() == theirs.keys() and any("tok_embeddings" in k for k in ours)
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, different


@pytest.mark.dist
def test_a_flipped_ddp_optimizer_state_names_its_rank_and_warn_goes_on(runs):
    dump, log = runs["ddp"]
    # the flipped moment may also move that rank's weight in the next update, or be rounded away in it (which of
    # the two depends on the optimizer kernel's arithmetic, and so on the torch version): the state is named either way
    first = next(line for line in log.splitlines() if "sdc: after step 4 the data-parallel replicas differ: " in line)
    assert "optimizer exp_avg of tok_embeddings.weight on rank(s) 1" in first, first
    records = read_metrics(dump)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["sdc_checks"] == STEPS // 2 and records[-1]["sdc_mismatches"] >= 1
    assert sorted(os.listdir(os.path.join(dump, "sdc")))[0] == "step-4.json"


def test_the_planner_states_the_checks_cost_from_the_replicas_state():
    """5 bytes moved per byte of a replica's parameters and Adam moments (planner/sdc.py), at the device's
    streaming bandwidth; without replicas one micro-batch's forward; ZeRO-1's sharded moments are not compared."""
    from torchtrain.components.hardware import KNOWN_GPUS
    from torchtrain.planner import sdc
    from torchtrain.planner.compute_time import memory_seconds
    from torchtrain.planner.core import load_job, plan_from_flags

    job = load_job([*TINY_JOB, "--fault.sdc_check_freq", "10", "--checkpoint.enable", "--checkpoint.interval", "50"])
    hsdp = plan_from_flags(job, 4, "h100", {"dp_replicate": 2}, trace=False)
    cost, rows = hsdp.sdc, hsdp.ranks[0].analytic.rows
    state = sum(r.bytes for r in rows if r.name.startswith(("parameters", "optimizer state")))
    assert cost.replicas == 2 and cost.state_bytes == state > 0
    assert cost.check_s == pytest.approx(memory_seconds(KNOWN_GPUS["h100"], 5 * state))
    assert cost.per_step_s == pytest.approx(cost.check_s * (1 / 10 + 1 / 50))
    assert sdc.describe(cost).startswith("every 10 steps and before each save: ")
    fsdp = plan_from_flags(job, 4, "h100", {}, trace=False)  # no replicas: a micro-batch's forward again
    assert fsdp.sdc.replicas == 1 and fsdp.sdc.check_s == pytest.approx(fsdp.throughput.compute_s / 3)
    pp = plan_from_flags(job, 4, "h100", {"pp": 2}, trace=False)
    assert pp.valid and pp.sdc is None  # a pipeline cannot run a forward again
    zero1 = plan_from_flags(job, 4, "h100", {"strategy": "zero1"}, trace=False)
    params = sum(r.bytes for r in zero1.ranks[0].analytic.rows if r.name.startswith("parameters"))
    assert zero1.sdc.replicas == 4 and zero1.sdc.state_bytes == params  # its moments are sharded: not compared


@pytest.mark.dist
def test_abort_stops_every_rank_at_the_check_with_the_evidence(runs):
    dump, log = runs["abort"]
    assert "after step 2 the data-parallel replicas differ (tok_embeddings.weight on rank(s) 2); " \
           'fault.sdc_policy is "abort"' in log
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]  # the step of the check is logged first
    assert os.path.exists(os.path.join(dump, "sdc", "step-2.json"))


FSDP = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """One launch of 2 ranks, pure FSDP: checked every 2 steps (clean); the same with the first micro-batch's
    logits flipped on rank 1 at step 4 (rolled back to step 2); unchecked."""
    work = tmp_path_factory.mktemp("sdc_fsdp")
    dumps = {name: str(work / name) for name in ("clean", "flipped", "unchecked")}
    argvs = [job(dumps["clean"], *FSDP),
             job(dumps["flipped"], *FSDP, "--debug.inject_bitflip_step", "4", "--debug.inject_bitflip_rank", "1",
                 "--debug.inject_bitflip_target", "output"),
             job(dumps["unchecked"], *FSDP, "--fault.sdc_check_freq", "0")]
    outcomes = run_together(argvs, 2, str(work))
    for (rc, log), name in zip(outcomes, dumps):
        assert rc == 0, (name, log[-3000:])
    return {name: (dump, log) for (name, dump), (_, log) in zip(dumps.items(), outcomes)}


@pytest.mark.dist
def test_a_corrupted_output_under_fsdp_is_caught_by_running_the_forward_again(fsdp_runs):
    (clean, clean_log), (flipped, log), (unchecked, _) = (fsdp_runs[k] for k in ("clean", "flipped", "unchecked"))
    assert "the first micro-batch's forward runs again" in clean_log
    assert ("sdc: after step 4 a forward run again differs: the first micro-batch's output (logits), computed "
            "again on rank(s) 1") in log
    assert "sdc: rolled back from step 4 to step-2" in log
    records = read_metrics(flipped)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 3, 4, 5, 6, 7, 8]
    assert records[-1]["sdc_mismatches"] == 1 and records[-1]["sdc_checks"] == STEPS // 2 + 1  # step 4 checked twice
    ours = flat(load(os.path.join(flipped, "checkpoint", f"step-{STEPS}")))
    theirs = flat(load(os.path.join(clean, "checkpoint", f"step-{STEPS}")))
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    # the checks themselves change nothing: every logged value of the checked run equals the unchecked one
    fields = ("loss", "grad_norm", "lr", "tokens_seen")
    assert [[r[f] for f in fields] for r in read_metrics(clean)] == \
        [[r[f] for f in fields] for r in read_metrics(unchecked)]
