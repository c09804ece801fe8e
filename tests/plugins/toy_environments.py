"""Environments of the tests' own (`grpo.environment = "toy_environments:..."`, torchtrain/posttrain/environments.py)."""

from __future__ import annotations

AGAIN = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


class Again:
    """Asks once more, whatever the first answer; the second is rewarded 1 when it is the answer: every episode has
    two turns of the model with the environment's turn between them."""

    def reset(self, prompt: str, answer: str) -> str:
        self.answer, self.turns = answer.strip(), 0
        return ""

    def step(self, text: str) -> tuple[str, float, bool]:
        self.turns += 1
        if self.turns == 1:
            return AGAIN, 0.0, False
        return "", float(text.strip() == self.answer), True


def again() -> Again:
    return Again()


class Broken:
    def reset(self, prompt: str, answer: str) -> str:
        raise RuntimeError("the sandbox is down")


def broken() -> Broken:
    return Broken()
