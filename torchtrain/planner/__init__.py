"""The planner (`python -m torchtrain.plan`): per-rank memory, pipeline bubble, throughput, cost, search."""
