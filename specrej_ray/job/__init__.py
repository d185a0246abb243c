"""The Ray-free job core: a spec's prompts prepared and its engine built, the shard
plan, the process runtime, stop signals and the in-process runner."""
