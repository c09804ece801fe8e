"""What the decoder families (Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3) share, stated once; a family
builds on these and never on another family.

* `transformer.py`: the decoder skeleton (embedding -> blocks -> norm -> output head), the pre-norm
  block and grouped-query attention; `rope.py`: RoPE tables (plain, Llama 3 scaled, YaRN) and pair
  layouts; `decoder.py`: argument checks and the initialisation scheme; `gqa_args.py`: the arguments
  of the explicit-head-width decoder (Qwen3 and Qwen3-MoE);
* `attention.py`: masked attention (causal / block-causal, the module context parallelism shards);
  `layers.py`: RMSNorm and the SwiGLU feed-forward; `moe.py`: the mixture-of-experts layer (router,
  load balancing, token dispatch) over `experts.py` (grouped GEMM or a portable loop); `mtp.py`:
  multi-token prediction; `extra_loss.py`: losses a module adds to the objective;
* `parallel.py`: the one layout check (TP / CP / sequence parallelism), FSDP units, pipeline split and
  the query/key-norm TP plan; `spec.py`: registration with the family's `ModelSpec` defaults;
  `hf.py`: Hugging Face names and config.json pieces.

No parallel code in the modules themselves: context and expert parallelism are applied from outside
(`distributed/context_parallel.py`, `distributed/expert_parallel.py`)."""
