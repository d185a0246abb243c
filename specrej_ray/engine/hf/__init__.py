"""The hand-written transformers engine (the `hf` backend): exact and seeded, the CPU
default and the reference every backend is tested against. Split like nano-vllm:
Engine.step() = Scheduler.schedule() (decides a Batch) -> the model runner runs it
(ModelRunner.prefill, decode, sample) -> Scheduler.postprocess()."""
