"""Exit statuses of a training process (and of the launcher, which passes them on; docs/resilience.md).

0 is a finished run, or one stopped by a preemption signal after its checkpoint was saved.
"""

CONFIG_ERROR = 2
"""A bad job (`torchtrain: config error: ...`, printed once); final: a restart would fail the same way."""

GUARD_ABORT = 3
"""The [guard] gave up on bad steps (`torchtrain: guard: ...`); final: a restart would repeat them."""

HANG = 4
"""The hang monitor found a rank without progress; its stacks are in `{dump_folder}/hangs/<time>/`.
A restart may help (torchrun restarts the workers when fault.max_restarts allows)."""

SAVE_FAILED = 5
"""Checkpoint saves failed `checkpoint.max_consecutive_save_failures` times in a row
(`torchtrain: checkpoint: ...`, printed once); final: the storage needs attention first."""

SILENT_CORRUPTION = 6
"""The replicas' values differed ([fault] sdc_check_freq, `sdc_policy = "abort"`, or no checkpoint to roll back
to; `torchtrain: sdc: ...` names the ranks); final: the hardware needs attention before a restart."""

FINAL = (CONFIG_ERROR, GUARD_ABORT, SAVE_FAILED, SILENT_CORRUPTION)
"""Statuses the launcher never restarts."""
