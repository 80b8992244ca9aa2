"""Engines: vLLM (vllm.py: the worker extension and the driver-side adapter; vllm_async.py: AsyncLLM in an async
actor; vllm_server.py: the OpenAI-compatible server; vllm_reload.py: the loaders, as a checkpoint load would;
vllm_model.py: checks against vLLM's own model code; vllm_version.py: what a worker's version says), and LoRA
adapters for a torch engine (torch_lora.py). docs/vllm.md says what is supported per vLLM version."""
