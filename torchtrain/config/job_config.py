"""The root config: one typed dataclass per TOML section, plus checks that span sections.

A later feature adds its section here (one field) and its dataclass in a module of its own; the
parser, `--help`, validation and the saved config pick it up without further changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from torchtrain.config.checkpoint import Checkpoint
from torchtrain.config.compute import ActivationCheckpoint, Compile
from torchtrain.config.dpo import Dpo, check_dpo
from torchtrain.config.evaluation import Eval
from torchtrain.config.fault import Fault, check_fault
from torchtrain.config.fields import ConfigError
from torchtrain.config.grpo import Grpo, check_grpo
from torchtrain.config.images import Images
from torchtrain.config.job import Debug, Job, Metrics, Model
from torchtrain.config.lora import Lora
from torchtrain.config.offload import Offload
from torchtrain.config.operations import Guard, Profiling, Validation, check_operations
from torchtrain.config.parallelism import Comm, Parallelism
from torchtrain.config.quantize import Quantize
from torchtrain.config.training import LRScheduler, Optimizer, Training


@dataclass
class JobConfig:
    """A whole training job. Section order here is the order of `--help` and of the saved config."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    images: Images = field(default_factory=Images)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    lora: Lora = field(default_factory=Lora)
    dpo: Dpo = field(default_factory=Dpo)
    grpo: Grpo = field(default_factory=Grpo)
    offload: Offload = field(default_factory=Offload)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    guard: Guard = field(default_factory=Guard)
    fault: Fault = field(default_factory=Fault)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)

    def validate(self) -> None:
        """Checks that need no process group: each section's own, then those across sections."""
        ckpt = self.checkpoint
        folder = self.model.overrides.get("hf_path")  # a Hugging Face model folder (model.name = "transformers")
        if self.model.hf_assets_path is None and isinstance(folder, str) and \
                os.path.isfile(os.path.join(folder, "tokenizer.json")):
            self.model.hf_assets_path = folder  # the model's own tokenizer is the default
        if ckpt.initial_load_in_hf and not ckpt.initial_load_path and self.model.hf_assets_path:
            ckpt.initial_load_path = self.model.hf_assets_path  # torchtitan's meaning: the HF folder of the model
        for name in self.__dataclass_fields__:
            check = getattr(getattr(self, name), "validate", None)
            if check is not None:
                check()
        check_operations(self)  # [profiling] [validation] [guard] against the other sections
        check_fault(self)  # [fault] and its debug injections
        check_dpo(self)  # [dpo] and the data and layouts it needs
        check_grpo(self)  # [grpo] likewise
        if self.lora.enable and self.checkpoint.last_save_in_hf:
            raise ConfigError("[checkpoint.last_save_in_hf] would export the frozen base weights without the LoRA "
                              "adapters: export with python -m torchtrain.tools.lora_export (merged or as a PEFT "
                              "adapter) instead")
        if self.compile.enable and self.metrics.track_tensor_memory:
            raise ConfigError("[metrics.track_tensor_memory] measures every operator in eager mode and cannot run "
                              "inside torch.compile's graphs; set compile.enable = false to measure memory")
