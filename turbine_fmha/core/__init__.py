"""The lowest layer: the array kinds and the dtype table (arrays), argument
checks (checks), device names (devices), where torch.compile's tracing
stops (tracing), and the environment variables (env). Imports nothing else
of the package."""
