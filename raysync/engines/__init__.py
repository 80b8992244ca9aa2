"""Engines: vLLM (vllm.py: the worker extension and the driver-side helpers; vllm_model.py: checks and
reloads against vLLM's own model code; vllm_version.py: what a worker's version says about its weights)."""
