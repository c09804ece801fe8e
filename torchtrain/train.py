"""The trainer's command: `torchrun ... -m torchtrain.train --job.config_file JOB.toml [--section.key value ...]`.

Parses the job, runs `trainer.Trainer`, and turns the ways a run ends into exit statuses
(utils/exit_codes.py): a config error, a guard abort, replicas found to differ or failing checkpoint saves
are one line on the log rank, no traceback.
"""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

from torchtrain.components.checkpoint import SaveFailed
from torchtrain.components.fault.replica_check import CorruptionAbort
from torchtrain.config import ConfigError, format_help, parse_args
from torchtrain.distributed.roles import job_roles
from torchtrain.distributed.utils import resolve_device
from torchtrain.models.registry import model_arguments
from torchtrain.posttrain.generator_ranks import serve
from torchtrain.trainer.guard import GuardAbort
from torchtrain.trainer.preflight import preflight
from torchtrain.trainer.trainer import Trainer
from torchtrain.utils import exit_codes
from torchtrain.utils.logging import init_logger, is_log_rank
from torchtrain.utils.process_exit import exit_process

# torchrun stops all workers as soon as one fails; a quiet rank that failed first would cut the log
# rank off before it printed the error.
QUIET_RANK_ERROR_EXIT_DELAY_S = 5.0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    init_logger()
    if "-h" in argv or "--help" in argv:
        print(format_help(argv, model_arguments))
        return 0
    trainer, finished = None, False
    try:
        cfg = parse_args(argv)
        roles = job_roles(cfg)
        if roles.is_generator:  # grpo.generator_ranks: this rank samples for the trainer ranks
            device = resolve_device(cfg.training.device)
            serve(cfg, preflight(cfg, roles.world, device.type), device)
            return 0
        trainer = Trainer(cfg)
        trainer.train()
        finished = True
    except ConfigError as e:
        if is_log_rank():
            print(f"torchtrain: config error: {e}", file=sys.stderr)
        else:  # every rank finds the error at once: let the log rank say it before torchrun stops the job
            time.sleep(QUIET_RANK_ERROR_EXIT_DELAY_S)
        return exit_codes.CONFIG_ERROR
    except GuardAbort as e:  # every rank raises it at the same step (docs/guard.md)
        finished = True  # ... so they can still tear down together
        if is_log_rank():
            print(f"torchtrain: guard: {e}", file=sys.stderr)
        return exit_codes.GUARD_ABORT
    except CorruptionAbort as e:  # every rank raises it after the same check (docs/resilience.md)
        finished = True
        if is_log_rank():
            print(f"torchtrain: sdc: {e}", file=sys.stderr)
        return exit_codes.SILENT_CORRUPTION
    except SaveFailed as e:  # every rank raises it after the same failed save (docs/checkpointing.md)
        finished = True
        if is_log_rank():
            print(f"torchtrain: checkpoint: {e}", file=sys.stderr)
        return exit_codes.SAVE_FAILED
    except BaseException as e:
        if trainer is not None:
            trainer.fault.on_error(e)  # a hang under way ends this rank as a hang, not as a crash
        raise
    finally:
        if trainer is not None:
            trainer.close(finished)
        elif dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())  # see exit_process: a clean run must not abort in interpreter teardown
