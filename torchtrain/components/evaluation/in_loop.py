"""What the trainer runs after a training step when due: validation on every held-out set
([validation], `components/evaluation/validation.py`) every `validation.freq` steps, and the downstream tasks
([eval], `scorer.py`) every `eval.freq` steps and after the last step. Both forward through the train
step's model parts in eval mode; their results join that step's metrics record.
"""

from __future__ import annotations

from torchtrain.components.evaluation.scorer import TaskEvaluator
from torchtrain.components.evaluation.tasks import Task, eval_seq_len
from torchtrain.components.evaluation.validation import HeldOutSet, Validator
from torchtrain.config.evaluation import Eval
from torchtrain.config.operations import Validation
from torchtrain.config.training import Training
from torchtrain.data.dataset import Source


class InLoopEvaluation:
    def __init__(self, validation: Validation, cfg: Eval, training: Training,
                 held_out: list[tuple[HeldOutSet, Source]], tasks: list[Task], tokenizer, train_step,
                 dump_folder: str, rank0: bool):
        self.validators = [Validator(s, validation.freq, training, source, train_step) for s, source in held_out]
        self.tasks = None if not tasks else TaskEvaluator(
            cfg, tasks, tokenizer, eval_seq_len(cfg, training.seq_len), train_step, dump_folder, rank0)
        self.eval_freq, self.last_step = cfg.freq, training.steps

    def _tasks_due(self, step: int) -> bool:
        return self.tasks is not None and (step % self.eval_freq == 0 or step == self.last_step)

    def due(self, step: int) -> bool:
        return any(v.due(step) for v in self.validators) or self._tasks_due(step)

    def run(self, step: int, phases) -> dict[str, float]:
        """Everything due at this step, timed as the `validation` and `eval` phases; the metrics."""
        out: dict[str, float] = {}
        for v in self.validators:
            if v.due(step):
                phases.enter("validation")
                out.update(v.run(step))
        if self._tasks_due(step):
            phases.enter("eval")
            out.update(self.tasks.run(step))
        phases.pause()
        return out
