"""The planner's command: will a job fit, on how many GPUs, how fast, at what cost -- before renting a GPU.

    python -m torchtrain.plan --config JOB.toml [--world-size N] [--gpu h100] [--search] [--json] \\
        [--tp 8 --pp 16 --ac full ...] [--section.key value ...]     (alias `torchtrain-plan`)

Runs on a laptop CPU in one process for any world size. See docs/planner.md and `planner/`.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from torchtrain.config import ConfigError
from torchtrain.planner.inputs import AC_MODES, PLANNER_KEYS, RESHARD, STRATEGIES
from torchtrain.utils import strict_json

EPILOG = """\
Any other argument is a job override, as for the trainer: --section.key value (e.g. --training.seq_len 8192).
Layout flags override the job file's values.

examples:
  python -m torchtrain.plan --config train_configs/llama3_70b.toml --world-size 64 --gpu h100
  python -m torchtrain.plan --config train_configs/llama3_70b.toml --world-size 64 --gpu h100 --search
  python -m torchtrain.plan --config train_configs/llama3_405b.toml --world-size 16384 --gpu h100 --json
  python -m torchtrain.plan --model.name qwen3_5 --model.flavor 9B-VL --world-size 8 --gpu h100 \
      --images-per-sample 2 --image-size 896x672
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m torchtrain.plan", allow_abbrev=False, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Will this job fit, on how many GPUs, how fast, at what cost: per-rank "
                                             "memory (analytic and traced), pipeline bubble, throughput and cost.")
    ap.add_argument("--config", help="job TOML file (as --job.config_file for the trainer)")
    ap.add_argument("--world-size", type=int, help="number of GPUs (default: the product of the job's degrees)")
    ap.add_argument("--gpu", default="h100", help="device type: a key of components/hardware.py KNOWN_GPUS "
                                                  "(h100, h200, a100, b200, ...) or cpu (default h100)")
    ap.add_argument("--memory-gib", type=float, help="device memory in GiB (default: the GPU's)")
    ap.add_argument("--headroom", type=float, help="share of device memory kept free (default 0.1)")
    ap.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (default: the GPU's, by dtype)")
    ap.add_argument("--device", action="append", default=[], metavar="FIELD=VALUE",
                    help="override one figure of the device table (components/hardware.py), e.g. "
                         "--device inter_node_gbps=25 for 200 Gb/s NICs; repeatable. With --gpu cpu: the CPU's "
                         "measured rates, e.g. --device fp32_tflops=0.3 --device hbm_tbps=0.02")
    ap.add_argument("--document-tokens", type=float,
                    help="mean document length, for block-causal attention's FLOPs (default: counted as causal)")
    ap.add_argument("--images-per-sample", type=float,
                    help="images per sequence (a mean) of a vision-language job, e.g. a qwen3_5 -VL flavor (default 0)")
    ap.add_argument("--image-size", type=_image_size, metavar="HxW",
                    help="the images' height x width in pixels before the processor resizes them (default 448x448)")
    ap.add_argument("--price", type=float, help="$ per GPU-hour (default 2.5)")
    ap.add_argument("--tokens", type=float, help="token budget to train (default 20 x parameters)")
    ap.add_argument("--failure-rate", type=float,
                    help="unexpected interruptions per GPU-hour (default 1.97e-5: Llama 3 405B's 419 in 54 days on "
                         "16,384 GPUs); 0 leaves interruptions out")
    ap.add_argument("--restart-minutes", type=float,
                    help="minutes one interruption costs before training goes on: detection, restart, checkpoint "
                         "load (default 10)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--no-trace", action="store_true", help="analytic estimate only (skip the traced step)")
    g = ap.add_argument_group("layout (override the job file)")
    g.add_argument("--dp-shard", type=int)
    g.add_argument("--dp-replicate", type=int)
    g.add_argument("--tp", type=int, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, help="pipeline-parallel degree")
    g.add_argument("--cp", type=int, help="context-parallel degree (sequences split over this many ranks)")
    g.add_argument("--ep", type=int, help="expert-parallel degree (MoE models; borrowed from dp-shard x tp)")
    g.add_argument("--strategy", choices=STRATEGIES,
                   help="data-parallel strategy (zero3 = FSDP/HSDP; see docs/planner.md)")
    g.add_argument("--reshard", choices=RESHARD, help="FSDP reshard after forward")
    g.add_argument("--ac", choices=AC_MODES, help="activation checkpointing mode")
    g.add_argument("--ac-option", help='selective AC: "op", "cheap" (the modules the model declares cheap to recompute) '
                                        'or N (every N-th block)')
    g.add_argument("--schedule", choices=("1F1B", "GPipe", "Interleaved1F1B"), help="pipeline schedule")
    g.add_argument("--microbatch-size", type=int, help="pipeline micro-batch size (sequences)")
    g.add_argument("--microbatches", type=int, help="pipeline micro-batches per local batch (sets the local batch)")
    g.add_argument("--stages-per-rank", type=int, help="virtual pipeline stages per rank (interleaved)")
    g.add_argument("--cpu-offload", action="store_true", default=None, help="FSDP CPU offload")
    g.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"),
                   help="optimizer state in host memory or on NVMe (offload.optimizer)")
    g.add_argument("--offload-params", choices=("none", "cpu", "nvme"),
                   help="parameter shards in host memory or on NVMe (offload.params; cpu = FSDP CPU offload)")
    ap.add_argument("--host-memory-gib", type=float, help="host memory per node in GiB (default: the device table's)")
    ap.add_argument("--nvme-gib", type=float, help="local NVMe capacity per node in GiB (default: the device table's)")
    s = ap.add_argument_group("search")
    s.add_argument("--search", action="store_true",
                   help="enumerate layouts for --world-size x --gpu, rank those that fit")
    s.add_argument("--top", type=int, default=10, help="entries shown (default 10)")
    s.add_argument("--verify", type=int, default=1, help="trace the best N entries to confirm they fit (default 1)")
    s.add_argument("--show-rejected", action="store_true", help="list every rejected layout with its reason")
    s.add_argument("--search-ac", default="none,selective,full", help="AC modes to try (default none,selective,full)")
    s.add_argument("--strategies", default="zero3", help="data-parallel strategies to try, e.g. zero3,zero2,zero1,ddp "
                                                         "(default zero3)")
    s.add_argument("--runnable-only", action="store_true", help="only layouts this torchtrain build can start")
    return ap


def _image_size(text: str) -> tuple[int, int]:
    """"HxW" -> (H, W)."""
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HxW (e.g. 448x448)") from None
    return h, w


def _flags(ns: argparse.Namespace) -> dict:
    flags = {"dp_shard": ns.dp_shard, "dp_replicate": ns.dp_replicate, "tp": ns.tp, "pp": ns.pp, "cp": ns.cp, "ep": ns.ep,
             "strategy": ns.strategy, "reshard_after_forward": ns.reshard, "ac_mode": ns.ac, "ac_option": ns.ac_option,
             "pp_schedule": ns.schedule, "pp_microbatch_size": ns.microbatch_size,
             "pp_stages_per_rank": ns.stages_per_rank, "cpu_offload": ns.cpu_offload,
             "offload_optimizer": ns.offload_optimizer, "offload_params": ns.offload_params, "memory_gib": ns.memory_gib,
             "headroom": ns.headroom, "price": ns.price, "tokens": ns.tokens, "document_tokens": ns.document_tokens,
             "failure_rate": ns.failure_rate, "images_per_sample": ns.images_per_sample, "image_size": ns.image_size,
             "restart_s": None if ns.restart_minutes is None else 60 * ns.restart_minutes}
    if ns.microbatches is not None:
        flags["local_batch_size"] = ns.microbatches * (ns.microbatch_size or 1)
    return flags


def _world_size(ns: argparse.Namespace, job) -> int:
    if ns.world_size is not None:
        return ns.world_size
    par = job.cfg.parallelism
    degrees = [ns.dp_replicate or par.data_parallel_replicate_degree,
               ns.dp_shard or par.data_parallel_shard_degree,
               ns.tp or par.tensor_parallel_degree, ns.pp or par.pipeline_parallel_degree,
               ns.cp or par.context_parallel_degree]
    if -1 in degrees:
        raise ConfigError("--world-size is required when data_parallel_shard_degree is -1 (give the GPU count)")
    out = 1
    for d in degrees:
        out *= d
    return out


def main(argv: list[str] | None = None) -> int:
    from torchtrain.planner import report
    from torchtrain.planner.core import load_job, plan_from_flags, resolve_gpu
    from torchtrain.planner.from_job import inputs_from_config
    from torchtrain.planner.search import annotate_runnable, search

    ns, rest = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        bad = [a for a in rest if a.startswith("--") and "." not in a.split("=", 1)[0]]
        if bad and bad[0].split("=", 1)[0] == "--mfu":
            raise ConfigError("--mfu is gone: the step time comes from the device's measured kernel and link rates "
                              "(docs/planner.md, 'Time model'); to describe your own system, override its figures "
                              "with --device FIELD=VALUE")
        if bad:
            raise ConfigError(f"unknown planner flag {bad[0]} (see --help); job overrides look like "
                              f"--section.key value")
        job_argv = (["--job.config_file", ns.config] if ns.config else []) + rest
        job = load_job(job_argv)
        world = _world_size(ns, job)
        flags = _flags(ns)
        ns.device += [f"{k}={v}" for k, v in (("host_memory_gib", ns.host_memory_gib), ("nvme_gib", ns.nvme_gib))
                      if v is not None]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if ns.search:
                device_type, gpu = resolve_gpu(ns.gpu, ns.device)
                base = inputs_from_config(job.cfg, job.args, world, device_type, gpu,
                                          {k: v for k, v in flags.items() if k in PLANNER_KEYS})
                result = search(job, base, ns.search_ac.split(","), ns.strategies.split(","), ns.verify, ns.peak_tflops,
                                ns.runnable_only, show_progress=True, cp=ns.cp)
                offload_note = ""
                if not result.ranked and not (base.cpu_offload or base.offload_optimizer != "none"):
                    from torchtrain.planner.fewest import search_with_offload

                    _, result = search_with_offload(job, {k: v for k, v in flags.items() if k in PLANNER_KEYS},
                                                    world, ns.gpu, ns.device, ns.search_ac.split(","),
                                                    ns.strategies.split(","), ns.verify, ns.peak_tflops,
                                                    ns.runnable_only, ns.cp)
                    offload_note = ("no layout fits on the GPUs alone; with the parameters, gradients and optimizer "
                                    "state in host memory (--offload-params cpu --offload-optimizer cpu):\n")
                annotate_runnable(job, result, ns.top)
                data = report.search_to_dict(result, ns.top, ns.show_rejected) if ns.json else None
                out = strict_json.dumps(data, indent=1) if ns.json else offload_note + report.format_search(
                    result, ns.top, ns.show_rejected)
            else:
                plan = plan_from_flags(job, world, ns.gpu, flags, trace=not ns.no_trace, peak_tflops=ns.peak_tflops,
                                       device=ns.device)
                fewest = None
                if plan.fits is False:  # how few GPUs would: without offload, and with these offload flags
                    from torchtrain.planner.fewest import fewest_gpus

                    fewest = (fewest_gpus(job, ns.gpu, flags, ns.device), fewest_gpus(job, ns.gpu, flags, ns.device,
                                                                                        offload=True))
                out = strict_json.dumps(report.plan_to_dict(plan, fewest), indent=1) if ns.json else \
                    report.format_plan(plan, fewest)
    except ConfigError as e:
        print(f"torchtrain.plan: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
