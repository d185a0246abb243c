"""The vLLM backend: speculative rejection inside vLLM's continuous batch (engine.VllmEngine).

Every candidate is one vLLM request; a decision aborts the losers' requests, which frees their
KV blocks at once, and vLLM's own scheduler admits the waiting candidates into the room. Only
engine.py and build.py import vllm (an optional extra, `specrej-ray[vllm]`).
"""
