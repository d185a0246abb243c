"""The vLLM backend: speculative rejection inside vLLM's continuous batch (engine.VllmEngine).

Every candidate is one vLLM request; a decision aborts the losers' requests, which frees their
KV blocks at once, and vLLM's own scheduler admits the waiting candidates into the room. vLLM
is an optional extra (`specrej-ray[vllm]`): candidate_sampler imports it when loaded, the
other modules only inside the functions that run it. Whatever of vLLM is private or
version-specific is reached through vllm_internals alone, which checks it is still there.
"""
