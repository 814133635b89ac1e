"""torch.compile: regional compilation, its cache, start-up and recompile monitoring."""
