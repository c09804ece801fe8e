"""The part of Hugging Face Accelerate's surface that is not offered, and the error that says so.

`Accelerator` implements the subset a plain training loop uses (docs/accelerate.md). Every other
well-known method, attribute or constructor argument of Accelerate's `Accelerator` is listed here, so
that using one fails at once with a line naming it, instead of an AttributeError or a silently
ignored keyword.
"""

from __future__ import annotations

from torchtrain.config.fields import ConfigError

UNSUPPORTED_METHODS = frozenset({
    "gather", "reduce", "pad_across_processes", "autocast", "free_memory", "clear", "register_for_checkpointing",
    "register_save_state_pre_hook", "register_load_state_pre_hook", "save_model", "save", "load", "get_state_dict",
    "split_between_processes", "main_process_first", "local_main_process_first", "on_main_process",
    "on_local_main_process", "on_process", "on_local_process", "on_last_process", "no_sync", "trigger_sync_in_backward",
    "join_uneven_inputs", "skip_first_batches", "init_trackers", "log", "end_training", "get_tracker",
    "set_trigger", "check_trigger", "prepare_model", "prepare_optimizer", "prepare_scheduler",
    "prepare_data_loader", "clip_grad_value_", "unscale_gradients", "verify_device_map", "profile",
    "lomo_backward", "deepspeed_plugin", "fsdp_plugin", "state", "is_local_main_process", "is_last_process",
    "local_process_index", "optimizer_step_was_skipped", "use_distributed", "distributed_type", "project_dir",
    "logging_dir", "save_iteration", "trackers", "scaler", "native_amp", "use_seedable_sampler",
    "non_blocking", "use_stateful_dataloader", "even_batches", "dispatch_batches", "step_scheduler_with_optimizer",
    "gradient_state", "sync_each_batch",
})
"""Accelerate `Accelerator` methods and attributes this implementation does not provide."""

UNSUPPORTED_ARGUMENTS = frozenset({
    "device_placement", "deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "torch_tp_plugin",
    "megatron_lm_plugin", "rng_types", "log_with", "project_dir", "project_config", "gradient_accumulation_plugin",
    "step_scheduler_with_optimizer", "kwargs_handlers", "dynamo_backend", "dynamo_plugin", "parallelism_config",
    "deepspeed_plugins", "dataloader_config", "dispatch_batches", "even_batches", "use_seedable_sampler",
    "logging_dir", "fp8_recipe_handlers", "downcast_bf16",
})
"""Accelerate `Accelerator(...)` keyword arguments this implementation does not take."""


class NotSupportedError(ConfigError):
    """A part of Accelerate's API that torchtrain.accelerate does not implement (one line, naming it)."""


def unsupported_method(name: str) -> NotSupportedError:
    return NotSupportedError(
        f"Accelerator.{name} is not supported by torchtrain.accelerate (supported: prepare, backward, accumulate, "
        f"clip_grad_norm_, gather_for_metrics, print, wait_for_everyone, save_state, load_state, unwrap_model, "
        f"device, num_processes, process_index, is_main_process; see docs/accelerate.md)")


def check_arguments(kwargs: dict) -> None:
    """Reject Accelerate constructor arguments that are not implemented, and unknown ones."""
    for name in kwargs:
        if name in UNSUPPORTED_ARGUMENTS:
            raise NotSupportedError(f"Accelerator({name}=...) is not supported by torchtrain.accelerate; give the "
                                    f"layout through parallelism=... instead (docs/accelerate.md)")
        raise NotSupportedError(f"Accelerator got an unknown argument {name!r} (neither torchtrain.accelerate's nor "
                                f"Hugging Face Accelerate's; see docs/accelerate.md)")
