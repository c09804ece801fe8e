"""What [dpo] and [grpo] ask of the other sections alike: their kind of data, and the run features they do not take
yet (replica-group fault tolerance, held-out validation)."""

from __future__ import annotations

from torchtrain.config.fields import ConfigError


def check_loss_section(job, section: str, enabled: bool, dataset: str, loss: str, reads: str, logs: str) -> bool:
    """Whether `section` (its `enable`) is on, after checking that it and `training.dataset = dataset` go together and
    that the run has nothing it does not take; one ConfigError line naming the key otherwise. `loss`, `reads` and
    `logs` word the messages (the loss, what it reads, what its steps log)."""
    training = job.training
    if training.dataset == dataset and not enabled:
        raise ConfigError(f"[training.dataset] \"{dataset}\" data trains with {loss}: set {section}.enable = true")
    if not enabled:
        return False
    if training.dataset != dataset:
        raise ConfigError(f"[{section}.enable] {loss} reads {reads}: set training.dataset = \"{dataset}\" (not "
                          f"{training.dataset!r}) and training.dataset_path to their JSONL file")
    if job.fault.replica_ft:
        raise ConfigError(f"[fault.replica_ft] {loss} does not run with replica groups yet")
    if job.validation.enable:
        raise ConfigError(f"[validation.enable] held-out validation measures cross-entropy, not {loss}: turn it off "
                          f"for a [{section}] job (the step logs {logs})")
    return True
