"""Building blocks shared by model families (attention with masks; more as families arrive)."""
