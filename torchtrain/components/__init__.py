"""Training components: tokenizer, data, optimizer, LR schedule, loss, metrics, hardware facts."""
