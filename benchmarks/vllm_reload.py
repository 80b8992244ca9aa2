"""What raysync's safety around vLLM's CPU reload costs, on a real model layout (allocated, not downloaded).

    python benchmarks/vllm_reload.py [--layout qwen2.5-0.5b] [--json out.json]

One vLLM CPU engine in this process (random weights, ``load_format="dummy"``), then inside its worker:

    check     the push checked against the model (raysync.engines.vllm_model: vLLM's loader on a meta twin), the
              first time for a layout, then again (a push of the same layout: the worker's cache)
    undo      what Undo keeps before a reload (a copy of the tensors the reload writes in place), and its time
    reload    vLLM's reload_weights alone; re-making a tied output head; raysync's whole apply (check,
              undo, reload, tied head: StagedReload.finish)
    layerwise the same push bucket by bucket through LayerwiseLoad (the GPU path: copies handed to vLLM's layerwise
              reload, finalized at the end; BUCKET_TENSORS tensors a call)
    restore   a reload made to fail at the last layer, then undone: the time to fail and put the weights back

Figures go to docs/reliability.md ("vLLM: a push the engine refuses, a reload undone").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker runs in this process


BUCKET_TENSORS = 16  # tensors per call of the bucket-by-bucket loader


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(worker, layout: str) -> dict:
    """Runs inside the vLLM worker (collective_rpc)."""
    import torch

    from raysync.engines.vllm_model import PushCheck, Undo, follow_embedding, tied_heads
    from raysync.engines.vllm_reload import LayerwiseLoad, StagedReload
    from raysync.tools.models import allocate

    runner, model = worker.model_runner, worker.model_runner.get_model()
    weights = list(allocate(layout, dtype=torch.bfloat16).items())
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in weights]
    out: dict = {"tensors": len(weights), "push_bytes": sum(t.nbytes for _, t in weights)}
    check = PushCheck(runner, False, {})  # one cache, as a worker keeps it across pushes
    out["check_first_s"] = timed(lambda: check(entries))
    out["check_again_s"] = timed(lambda: check(entries))
    undo = []
    out["undo_keep_s"] = timed(lambda: undo.append(Undo(model)))
    out["undo_copy_bytes"] = sum(data.nbytes for _, _, data in undo.pop()._tensors)
    out["vllm_reload_s"] = timed(
        lambda: runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    )
    out["tied_heads"] = len(tied_heads(model))
    out["tied_head_remake_s"] = timed(lambda: follow_embedding(tied_heads(model)))
    staged = StagedReload(runner, check)
    staged(weights)
    out["raysync_apply_s"] = timed(staged.finish)
    bucketed = LayerwiseLoad(runner, check, on_cpu=True)  # the GPU path, here on the CPU

    def bucket_by_bucket() -> None:
        for k in range(0, len(weights), BUCKET_TENSORS):
            bucketed(weights[k : k + BUCKET_TENSORS])
        bucketed.close()

    out["layerwise_apply_s"] = timed(bucket_by_bucket)
    layer = [m for n, m in model.named_modules() if n.endswith("mlp.down_proj")][-1]  # the last layer's

    def fail(layer: torch.nn.Module) -> None:
        del layer.quant_method.process_weights_after_loading
        raise RuntimeError("injected")

    layer.quant_method.process_weights_after_loading = fail
    staged(weights)
    t = time.perf_counter()
    try:
        staged.finish()
    except Exception as e:
        out["failed_apply_then_restore_s"] = time.perf_counter() - t
        out["failure"] = type(e).__name__
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="qwen2.5-0.5b")
    ap.add_argument("--json")
    args = ap.parse_args()

    from transformers import Qwen2Config
    from vllm import LLM

    from raysync.tools.models import LAYOUTS

    shape = LAYOUTS[args.layout]
    with tempfile.TemporaryDirectory() as model_dir:
        Qwen2Config(
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            vocab_size=shape.vocab,
            tie_word_embeddings=shape.tied,
            torch_dtype="bfloat16",
        ).save_pretrained(model_dir)
        llm = LLM(
            model_dir,
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=160,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=32 << 20,
            worker_extension_cls="raysync.engines.vllm.WorkerExtension",
        )
        try:
            result = llm.collective_rpc(measure, args=(args.layout,))[0]
        finally:
            llm.llm_engine.engine_core.shutdown(timeout=60)
    result |= {
        "layout": args.layout,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    for key in (
        "tensors",
        "push_bytes",
        "check_first_s",
        "check_again_s",
        "undo_keep_s",
        "undo_copy_bytes",
        "vllm_reload_s",
        "tied_heads",
        "tied_head_remake_s",
        "raysync_apply_s",
        "layerwise_apply_s",
        "failed_apply_then_restore_s",
        "failure",
    ):
        value = result.get(key)
        shown = (
            f"{value / 1e6:.1f} MB"
            if key.endswith("bytes")
            else f"{value:.3f}"
            if isinstance(value, float)
            else value
        )
        print(f"{key:30s} {shown}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
