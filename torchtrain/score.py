"""python -m torchtrain.score: a checkpoint's mean reward on prompts with reference answers (inference/scoring.py)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from torchtrain.config.fields import ConfigError


def build_parser() -> argparse.ArgumentParser:
    from torchtrain.inference import scoring

    ap = argparse.ArgumentParser(prog="python -m torchtrain.score", allow_abbrev=False, description=scoring.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="DCP checkpoint (dump, checkpoint or step-N folder) or an "
                    "HF folder, as for python -m torchtrain.generate")
    ap.add_argument("--prompts", required=True, help="JSONL of {\"prompt\" or \"messages\", \"answer\"}")
    ap.add_argument("--config", help="the job's TOML file (default: the job_config.toml saved above the checkpoint)")
    ap.add_argument("--reward-funcs", nargs="*", help="default: the job's grpo.reward_funcs; none after it: no "
                    "reward function (an environment's rewards alone)")
    ap.add_argument("--samples", type=int, default=1, help="completions per prompt (default 1)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, help="default: the job's grpo.max_completion_length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--environment", help="multi-turn episodes with this factory, \"package.module:function\" "
                    "(default: the job's grpo.environment)")
    ap.add_argument("--max-turns", type=int, help="default: the job's grpo.max_turns")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns, overrides = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        from torchtrain.config import parse_args
        from torchtrain.data.tokenizer import stop_ids
        from torchtrain.inference.generation import find_job_config, load
        from torchtrain.inference.scoring import score
        from torchtrain.posttrain.decoding import Sampling
        from torchtrain.posttrain.environments import Environments
        from torchtrain.posttrain.rewards import Rewards, import_function

        if ns.samples < 1 or ns.temperature < 0:
            raise ConfigError("--samples must be >= 1 and --temperature >= 0")
        config = ns.config or find_job_config(ns.checkpoint)
        grpo = parse_args((["--job.config_file", config] if config else []) + overrides).grpo
        job = load(ns.checkpoint, config, overrides, torch.device("cpu"), torch.float32)
        given = ns.reward_funcs is not None
        rewards = Rewards(ns.reward_funcs if given else grpo.reward_funcs, [] if given else grpo.reward_weights,
                          grpo.format_pattern)
        path = ns.environment or grpo.environment
        environments = Environments(import_function(path, "--environment"), path) if path else None
        result = score(job, ns.prompts, rewards, ns.max_new_tokens or grpo.max_completion_length,
                       Sampling(ns.temperature, 0, ns.top_p), ns.samples, ns.seed,
                       stop_ids(job.tokenizer, grpo.stop_token_ids), environments=environments,
                       max_turns=ns.max_turns or grpo.max_turns)
    except (ConfigError, OSError) as e:
        print(f"torchtrain.score: error: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(vars(result)))
    else:
        print(f"mean reward {result.mean_reward:.4f} over {result.completions} completions of {result.prompts} "
              f"prompts ({', '.join(rewards.names + ([path] if environments else []))}; {result.skipped} prompts too long skipped, "
              f"{result.reward_errors} reward errors)")
    return 0


if __name__ == "__main__":
    from torchtrain.utils.process_exit import exit_process

    exit_process(main())
