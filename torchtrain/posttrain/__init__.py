"""Post-training: what a run optimises beyond next-token cross-entropy, each objective in one place behind the
trainer's one seam (`trainer/objective.py`; built by `objectives.build_objective`).

* DPO (and IPO, SimPO): `dpo.py` (the objective), `preference_loss.py`, `reference.py` (a frozen copy, the base
  under LoRA, or a precomputed table); the pairs are data (`data/preference/pairs.py`).
* GRPO: `grpo.py` (the objective), `rollout.py` (the loader that samples and rewards), `policy_loss.py`,
  `rewards.py`, `decoding.py` (batched sampling with a key/value cache), `sampling_layout.py` (sampling in the
  training layout, or from an unsharded copy), `reference.py` (the KL term's); the prompts are data
  (`data/prompts.py`).
"""
