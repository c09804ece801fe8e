"""Write a synthetic chat set: user turns of random lowercase letters, answers by a fixed rule.

The answer to a user turn u is ``"Answer: " + u[0] + u[0]`` (its first letter, twice). The user turns
carry log(26) ~ 3.26 nats per letter that no model can predict, while the answers are learnable, so a
loss counted on the answers only falls far below what counting the user turns would allow
(docs/finetuning.md)::

    python scripts/synthetic_chat.py OUT.jsonl [--conversations 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "Reply with the rule."})
    for _ in range(rng.randint(1, 2)):
        user = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(8, 40)))
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": f"Answer: {user[0] * 2}"}]
    return {"messages": messages}


def write_task(path: str, conversations: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(conversations):
            f.write(json.dumps(conversation(rng)) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    write_task(a.out, a.conversations, a.seed)


if __name__ == "__main__":
    main()
