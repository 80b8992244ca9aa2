"""Engines: where a push lands in an inference engine.

vLLM (docs/vllm.md says what is supported per vLLM version): vllm.py, the worker extension and the driver-side
adapter (VllmEngine); vllm_async.py, AsyncLLM in an async actor; vllm_server.py, the OpenAI-compatible server;
vllm_reload.py, the loaders (a push ends as a checkpoint load would); vllm_model.py, a push checked against
vLLM's own model code; vllm_version.py, what a worker's version says; vllm_lora.py, LoRA adapters loaded into
vLLM from pushed tensors. A plain torch engine's LoRA adapter versions: torch_lora.py."""
