"""Under torchrun: a block-causal model parallelised as the job's layout says (e.g. TP 2) computes, for a
packed batch, the logits of every document exactly as a single process running that document alone."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtrain.config import parse_args
from torchtrain.distributed.parallelize import build_model_parts
from torchtrain.distributed.param_init import init_model_weights
from torchtrain.trainer.preflight import preflight
from torchtrain.utils.process_exit import exit_process

cfg = parse_args(sys.argv[1:])
dist.init_process_group("gloo")
job = preflight(cfg, dist.get_world_size(), "cpu")
job.layout.dims.build_mesh("cpu")
spec, args = job.model_spec, job.model_args
assert args.attention_mask == "block_causal"
(model,) = build_model_parts(spec, args, job.layout, torch.device("cpu"), seed=3)
reference = spec.model_cls(args)
init_model_weights(reference, seed=3)

lengths = [5, 9, 3, 15]  # 32 tokens: four documents packed in one sequence
gen = torch.Generator().manual_seed(0)
docs = [torch.randint(0, args.vocab_size, (n,), generator=gen) for n in lengths]
tokens = torch.cat(docs)[None]
positions = torch.cat([torch.arange(n) for n in lengths])[None]
with torch.no_grad():
    packed = model(tokens, positions=positions)
    packed = packed.full_tensor() if isinstance(packed, DTensor) else packed
    start, worst = 0, 0.0
    for doc in docs:
        alone = reference(doc[None])  # the document by itself, causal from position 0
        torch.testing.assert_close(packed[:, start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
        worst = max(worst, (packed[:, start:start + len(doc)] - alone).abs().max().item())
        start += len(doc)
if dist.get_rank() == 0:
    print(f"BLOCK-CAUSAL-OK {job.layout.describe()} max abs diff {worst:.2e}")
dist.barrier()
dist.destroy_process_group()
exit_process(0)
