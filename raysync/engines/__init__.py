"""Engines: vLLM (vllm.py: the worker extension and the driver-side helpers; vllm_model.py: checks and
reloads against vLLM's own model code)."""
