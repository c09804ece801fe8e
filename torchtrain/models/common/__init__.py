"""Building blocks shared by model families: norms and feed-forward layers (`layers.py`), and the
mixture-of-experts layer (`moe.py`: router, load balancing, token dispatch) over its expert
computation (`experts.py`: grouped GEMM or a portable loop). No parallel code: expert parallelism is
applied from outside (`distributed/expert_parallel.py`)."""
