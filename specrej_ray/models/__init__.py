"""Model sources resolved (packaged alias, local dir, .gguf, hub id) and loaded."""
