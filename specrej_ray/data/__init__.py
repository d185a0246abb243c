"""The data layer: prompts and the prompt store, content keys, the output directory
(its lock, its guard, resume and assembly), the dataset files and the training formats."""
