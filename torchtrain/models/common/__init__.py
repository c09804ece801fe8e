"""Building blocks shared by model families: masked attention (`attention.py`: causal / block-causal,
the module context parallelism shards), norms and feed-forward layers (`layers.py`), and the
mixture-of-experts layer (`moe.py`: router, load balancing, token dispatch) over its expert
computation (`experts.py`: grouped GEMM or a portable loop). No parallel code: context and expert
parallelism are applied from outside (`distributed/context_parallel.py`, `distributed/expert_parallel.py`)."""
