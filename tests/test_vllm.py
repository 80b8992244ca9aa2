"""Real vLLM engines (the CPU build) inside Ray actors receive a trainer's weights through WeightSync and then
generate what transformers generates with those weights; a push that does not fit the engine's model, or whose
reload fails inside vLLM, leaves the engine generating with the weights it had."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import os

import pytest
from vllm_cpu import EngineProcesses, engine, require_vllm_cpu, stop

ray = require_vllm_cpu()

import torch  # noqa: E402
from actors import ENGINE_ARGS, Policy, VllmHost, greedy  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.engines.vllm import VllmEngine, WorkerExtension  # noqa: E402
from raysync.tools.models import tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.vllm

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=30, progress=False)  # the embedding spans 4 buckets
PROMPTS = [list(range(3, 11)), [(7 * i) % 500 + 1 for i in range(80)]]  # the second fills 2 cache blocks
TOKENS = 8
ONE_PROCESS = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
TP2 = "tensor-parallel"  # shared_engines' key of the engine of two tensor-parallel workers


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[bool, str]:
    """The engines' starting checkpoints, {tied: path}: another random init than the trainers'."""
    paths = {}
    for tied in (False, True):
        paths[tied] = str(tmp_path_factory.mktemp("tiny-qwen2-tied" if tied else "tiny-qwen2"))
        tiny_qwen2(seed=1, tied=tied).save_pretrained(paths[tied])
    return paths


@pytest.fixture
def engines():
    """``engines(model_dir, runtime_env, host=..., **engine_args)`` starts an engine actor for this test only;
    at its end each is shut down and checked (``stop``)."""
    hosts: list = []

    def start(*args, **kwargs):
        hosts.append(engine(*args, **kwargs))
        return hosts[-1]

    yield start
    stop(hosts, EngineProcesses())


@pytest.fixture(scope="module")
def shared_engines(ray_local, model_dirs):
    """The module's engines, each started when a test first asks for it and shared by the tests (an engine
    start is most of a test's time): {False: one-process, untied; True: one-process, tied; TP2: untied, two
    tensor-parallel workers in vLLM's multiprocess layout}, with what each generated at its start.
    ``fresh_engine`` hands them out."""
    hosts: dict[bool | str, tuple] = {}

    def get(kind: bool | str):
        if kind not in hosts:
            if kind == TP2:
                env = {
                    "env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
                }  # one core per worker (one NUMA node)
                host = engine(model_dirs[False], env, tensor_parallel_size=2)
            else:
                host = engine(model_dirs[kind], ONE_PROCESS, host=FaultyHost)
            hosts[kind] = (host, ray.get(host.generate.remote(PROMPTS, TOKENS)))
        return hosts[kind]

    yield get
    stop([h for h, _ in hosts.values()], EngineProcesses())


@pytest.fixture
def fresh_engine(shared_engines):
    """``fresh_engine(kind)``: the module's engine of that kind (shared_engines), as if just started: vLLM's own
    ``reload_weights`` loads its checkpoint again (the engine then holds no version), and it is checked to
    generate what it generated when it started. The one-process engines' worker extension can break a reload
    (FaultyLoads).

    vLLM 0.32's reload_weights leaves an output head tied to the embedding as it was (the checkpoint holds no
    lm_head: "ParallelLMHead: Failed to load weights"), so the tied engine is pushed its checkpoint's weights
    first, from a trainer made from them."""
    checkpoint_trainer = []

    def get(kind: bool | str = False):
        host, started = shared_engines(kind)
        if kind is True:
            if not checkpoint_trainer:
                checkpoint_trainer.append(
                    ray.remote(num_cpus=0.25)(TiedPolicy).remote(seed=1)
                )  # model_dirs[True]
            with WeightSync(checkpoint_trainer, [VllmEngine(host)], CFG) as sync:
                sync.push(0)
        ray.get(host.__ray_call__.remote(reload_from_checkpoint))
        assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == started, "the checkpoint did not load again"
        assert ray.get(host.weight_version.remote()) is None
        return host

    return get


class TiedPolicy(Policy):
    """A trainer whose model ties its output head to the embedding (it sends that tensor once)."""

    def __init__(self, seed: int = 0):
        self.model = tiny_qwen2(seed, tied=True)


@pytest.mark.parametrize(
    ("transport", "tied"),
    [("shm", False), ("shm", True), ("collective", True)],
    ids=["shm", "shm-tied", "gloo-tied"],
)
def test_one_engine_generates_with_the_pushed_weights(transport, tied, ray_local, no_leftovers, fresh_engine):
    trainer = ray.remote(num_cpus=0.25)(TiedPolicy if tied else Policy).remote()
    host = fresh_engine(tied)
    with WeightSync([trainer], [VllmEngine(host)], CFG, transport=transport) as sync:
        assert [p.transport for p in sync.plan] == [transport]  # collective: a gloo group beside vLLM's
        before = ray.get(host.generate.remote(PROMPTS, TOKENS))
        assert ray.get(host.weight_version.remote()) is None
        for version in (1, 2, 3):  # the later pushes go through the CPU reload path again
            ray.get(trainer.step.remote(version))
            expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
            report = sync.push(version)
            assert report.pairs[0].bytes > 0
            got = ray.get(host.generate.remote(PROMPTS, TOKENS))  # the long prompt is in the prefix cache
            assert got == expected, f"version {version}"  # tied: the output head follows the embedding
            assert got != before
            before = got
        assert ray.get(host.weight_version.remote()) == 3 and sync.versions() == [3]
        assert sync.push(3).pairs[0].bytes == 0  # the same version again: nothing moves


# --- pushes that do not fit the engine's model --------------------------------------------------------------------
EXTRA = "model.layers.0.mlp.extra_proj.weight"  # no such parameter in Qwen2
NORM = "model.layers.1.input_layernorm.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # one of the three parts of vLLM's fused qkv_proj


class MisfitPolicy(Policy):
    """A trainer whose push can be made not to fit the engine's model, and that can say what a model made of
    two of its versions generates (the reference for a partial push)."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.misfit: str | None = None
        self.kept: dict[str, torch.Tensor] = {}

    def set_misfit(self, misfit: str | None) -> None:
        self.misfit = misfit

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = list(self.model.named_parameters())
        if self.misfit == "unknown name":
            return [*named, (EXTRA, torch.zeros(256, 128))]
        if self.misfit == "wrong shape":
            return [(n, t[:64] if n == NORM else t) for n, t in named]
        if self.misfit == "missing tensor":
            return [(n, t) for n, t in named if n != K_PROJ]
        return named

    def keep(self, seed: int | None = None) -> None:
        """Keep the current weights, or those of ``tiny_qwen2(seed)`` (an engine's starting checkpoint)."""
        model = self.model if seed is None else tiny_qwen2(seed)
        self.kept = {n: t.detach().clone() for n, t in model.state_dict().items()}

    def greedy_mixed(
        self, prompts: list[list[int]], tokens: int, patterns: tuple[str, ...]
    ) -> list[list[int]]:
        """Greedy tokens of the kept weights with the tensors matching ``patterns`` taken from the current ones."""
        mixed = copy.deepcopy(self.model)
        now = self.model.state_dict()
        mixed.load_state_dict(
            {n: now[n] if any(fnmatch.fnmatch(n, p) for p in patterns) else t for n, t in self.kept.items()}
        )
        return greedy(mixed, prompts, tokens)


def misfit_tensors(actor: MisfitPolicy) -> list[tuple[str, torch.Tensor]]:
    return actor.tensors()


def refusal(sync: WeightSync, version: int, stage: str) -> str:
    """The push fails, on the engine at ``stage``; the text of every endpoint's failure."""
    with pytest.raises(SyncError) as failed:
        sync.push(version)
    assert stage in [f.stage for f in failed.value.failures], failed.value
    return "\n".join(f.error for f in failed.value.failures)


def test_a_push_that_does_not_fit_the_model_is_refused_and_the_engine_keeps_its_weights(
    ray_local, model_dirs, no_leftovers, fresh_engine
):
    trainer = ray.remote(num_cpus=0.25)(MisfitPolicy).remote(seed=3)
    host = fresh_engine()
    with WeightSync([trainer], [VllmEngine(host)], CFG, source=misfit_tensors) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        old = ray.get(host.generate.remote(PROMPTS, TOKENS))
        assert old == ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
        ray.get(trainer.step.remote(2))  # a refused push would change the tokens if any of it landed
        for misfit, named in [
            ("unknown name", [EXTRA]),
            ("wrong shape", [NORM]),
            ("missing tensor", ["model.layers.0.self_attn.qkv_proj.weight"]),
        ]:
            ray.get(trainer.set_misfit.remote(misfit))
            text = refusal(sync, 2, "accept")  # before a byte moved
            assert all(n in text for n in named), f"{misfit}: {text}"
            assert "Qwen2ForCausalLM" in text and model_dirs[False] in text, text  # the engine's model
            assert "does not fit the engine's model" in text
            assert sync.versions() == [1], misfit  # refused at accept: nothing touched, not mixed
            assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == old, misfit
        ray.get(trainer.set_misfit.remote(None))
        sync.push(2)
        assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == ray.get(
            trainer.greedy.remote(PROMPTS, TOKENS)
        )
        assert sync.versions() == [2]


def test_a_partial_push_writes_whole_parameters_only(ray_local, no_leftovers, fresh_engine):
    """SyncConfig.include makes a push partial: engine parameters it leaves out keep their weights, but one it
    touches must be written completely (q_proj alone is a third of vLLM's qkv_proj)."""
    trainer = ray.remote(num_cpus=0.25)(MisfitPolicy).remote(seed=4)
    host = fresh_engine()
    norms = ("*layernorm.weight", "model.norm.weight")
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
    ray.get(trainer.keep.remote())
    ray.get(trainer.step.remote(2))
    q_only = dataclasses.replace(CFG, include=("model.layers.0.self_attn.q_proj.*",))
    with WeightSync([trainer], [VllmEngine(host)], q_only) as sync:
        text = refusal(sync, 2, "accept")
        assert "model.layers.0.self_attn.qkv_proj.weight" in text and "does not write completely" in text
    biases = dataclasses.replace(
        CFG, include=("model.layers.0.self_attn.*_proj.bias",)
    )  # all of qkv_proj.bias
    with WeightSync([trainer], [VllmEngine(host)], biases) as sync:
        text = refusal(
            sync, 2, "accept"
        )  # vLLM would reload qkv_proj from the bias and an uninitialized weight
        assert (
            "model.layers.0.self_attn.qkv_proj (weight left out)" in text and "reloads a layer whole" in text
        )
    with WeightSync([trainer], [VllmEngine(host)], dataclasses.replace(CFG, include=norms)) as sync:
        sync.push(2)
        assert sync.versions() == [2]
    assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == ray.get(
        trainer.greedy_mixed.remote(PROMPTS, TOKENS, norms)
    )


def test_a_partial_push_to_a_fresh_engine_names_no_version_until_every_weight_was_pushed(
    ray_local, model_dirs, no_leftovers, engines
):
    """Note [a version over every weight]: the parameters a partial push leaves out of a fresh engine hold its
    starting checkpoint, not the pushed version; the version counts once pushes have covered every parameter."""
    trainer = ray.remote(num_cpus=0.25)(MisfitPolicy).remote(seed=10)
    host = engines(model_dirs[False], ONE_PROCESS)
    ray.get(trainer.keep.remote(1))  # the engine's checkpoint (model_dirs: seed 1)
    ray.get(trainer.step.remote(1))
    norms = ("*layernorm.weight", "model.norm.weight")
    with WeightSync([trainer], [VllmEngine(host)], dataclasses.replace(CFG, include=norms)) as sync:
        for _ in range(2):  # the same version again: applied again, not skipped (no version to compare)
            assert sync.push(1).pairs[0].bytes > 0
            assert sync.versions() == [None] and ray.get(host.weight_version.remote()) is None
        assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == ray.get(
            trainer.greedy_mixed.remote(PROMPTS, TOKENS, norms)  # the checkpoint with the pushed norms
        )
    with WeightSync([trainer], [VllmEngine(host)], dataclasses.replace(CFG, exclude=norms)) as sync:
        assert sync.push(1).pairs[0].bytes > 0  # the rest: every parameter now holds version 1
        assert sync.versions() == [1] and ray.get(host.weight_version.remote()) == 1
        assert sync.push(1).pairs[0].bytes == 0  # the version it holds: skipped
    assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == ray.get(trainer.greedy.remote(PROMPTS, TOKENS))


# --- a reload that fails inside vLLM ------------------------------------------------------------------------------
BROKEN_LAYER = "model.layers.1.mlp.down_proj"  # after the embedding and layer 0 were reloaded


class FaultyLoads(WorkerExtension):
    """raysync's worker extension, plus a fault inside vLLM's load path: the next reload fails while vLLM
    processes one layer's loaded weights (repacking them for the CPU GEMM), after the layers before it took
    the new weights. (A weight loader that raised would be caught by the check before loading, which runs
    vLLM's loaders on the meta device: that is the misfit test.)"""

    def raysync_test_break_next_reload(self, layer_name: str) -> None:
        layer = self.model_runner.get_model().get_submodule(layer_name)
        method = layer.quant_method

        def fail_once(layer: torch.nn.Module) -> None:
            del method.process_weights_after_loading  # the next reload works again
            raise RuntimeError(f"injected: repacking {layer_name} failed")

        method.process_weights_after_loading = fail_once


class FaultyHost(VllmHost):
    def __init__(self, model_dir: str):
        from vllm import LLM

        self.llm = LLM(model_dir, worker_extension_cls="test_vllm.FaultyLoads", **ENGINE_ARGS)

    def break_next_reload(self, layer_name: str) -> None:
        self.llm.collective_rpc("raysync_test_break_next_reload", args=(layer_name,))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_reload_that_fails_part_way_is_undone(tied, ray_local, no_leftovers, fresh_engine):
    trainer = ray.remote(num_cpus=0.25)(TiedPolicy if tied else Policy).remote(seed=6)
    host = fresh_engine(tied)
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        old = ray.get(host.generate.remote(PROMPTS, TOKENS))
        ray.get(trainer.step.remote(2))
        ray.get(host.break_next_reload.remote(BROKEN_LAYER))
        text = refusal(sync, 2, "apply")  # returns within timeout_s: nothing waits on the broken engine
        assert f"injected: repacking {BROKEN_LAYER} failed" in text and "were put back" in text, text
        assert sync.versions() == [1] and ray.get(host.weight_version.remote()) == 1
        assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == old  # not a mix, not on the meta device
        sync.push(2)  # vLLM's reload state was reset too: the next push lands
        assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == ray.get(
            trainer.greedy.remote(PROMPTS, TOKENS)
        )
        assert sync.versions() == [2]


# --- more workers --------------------------------------------------------------------------------------------------
def test_two_engines_one_in_vllms_multiprocess_layout(ray_local, no_leftovers, fresh_engine):
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=5)
    hosts = [fresh_engine(), fresh_engine(TP2)]  # the second: vLLM's multiprocess layout, two workers
    with WeightSync([trainer], [VllmEngine(h) for h in hosts], CFG) as sync:
        assert [p.receiver for p in sync.plan] == [0, 1, 2]  # the second engine's workers: receivers 1 and 2
        host_pids = ray.get([h.__ray_call__.remote(lambda a: os.getpid()) for h in hosts])
        plan = str(sync.plan)
        assert f"pid {host_pids[0]}" in plan  # one process: the worker runs in the actor
        assert f"pid {host_pids[1]}" not in plan  # multiprocess: the worker is vLLM's own process
        ray.get(trainer.step.remote(1))
        expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
        sync.push(1)
        assert ray.get([h.generate.remote(PROMPTS, TOKENS) for h in hosts]) == [expected, expected]
        assert sync.versions() == [1, 1, 1]


def test_a_tensor_parallel_engine_is_one_receiver_per_worker(ray_local, no_leftovers, fresh_engine):
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=7)
    host = fresh_engine(TP2)
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        assert [(p.sender, p.receiver) for p in sync.plan] == [(0, 0), (0, 1)]  # each worker loads its shard
        ray.get(trainer.step.remote(1))
        expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
        report = sync.push(1)
        assert [p.receiver for p in report.pairs] == [0, 1]
        assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == expected
        assert sync.versions() == [1, 1] and ray.get(host.weight_version.remote()) == 1


# --- versions that cannot lie (Notes [an engine's version and its weights], [sleep, wake and the version]) --------
def reload_from_checkpoint(host: VllmHost) -> None:
    """vLLM's own reload, outside raysync: the engine loads its starting checkpoint again."""
    host.llm.collective_rpc("reload_weights")
    host.llm.reset_prefix_cache()


def negate_final_norm(host: VllmHost) -> None:
    """A write into one parameter through a collective_rpc of the user's own, outside raysync."""

    def write(worker) -> None:
        with torch.no_grad():
            worker.model_runner.get_model().get_parameter(
                "model.norm.weight"
            ).neg_()  # greedy picks the least likely

    host.llm.collective_rpc(write)
    host.llm.reset_prefix_cache()


def test_weights_changed_outside_raysync_leave_no_version_and_the_same_push_lands_again(
    ray_local, no_leftovers, fresh_engine
):
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=8)
    host = fresh_engine()
    start = ray.get(host.generate.remote(PROMPTS, TOKENS))
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        ray.get(trainer.step.remote(1))
        expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
        sync.push(1)
        assert sync.versions() == [1] and sync.push(1).pairs[0].bytes == 0  # unchanged: skipped
        for change in (reload_from_checkpoint, negate_final_norm):
            ray.get(host.__ray_call__.remote(change))
            got = ray.get(host.generate.remote(PROMPTS, TOKENS))
            assert got != expected, change.__name__
            if change is reload_from_checkpoint:
                assert got == start  # the checkpoint's weights, not v1's
            assert sync.versions() == [None] and ray.get(host.weight_version.remote()) is None
            report = sync.push(1)  # the same version: applied, not skipped
            assert report.pairs[0].bytes > 0, change.__name__
            assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == expected, change.__name__
            assert sync.versions() == [1] and ray.get(host.weight_version.remote()) == 1
            assert sync.push(1).pairs[0].bytes == 0  # the print of the new weights: skipped again


def sleep_and_wake(host: VllmHost, level: int) -> None:
    from raysync.engines.vllm import sleep, wake_up

    sleep(host.llm, level)
    wake_up(host.llm)
    assert not host.llm.llm_engine.is_sleeping()


def sleep_only(host: VllmHost, level: int) -> None:
    from raysync.engines.vllm import sleep

    sleep(host.llm, level)


def is_sleeping(host: VllmHost) -> bool:
    return host.llm.llm_engine.is_sleeping()


def test_sleep_level_1_keeps_the_version_and_level_2_forgets_it(ray_local, no_leftovers, fresh_engine):
    """vLLM's CPU build accepts sleep and wake_up and leaves its workers' weights where they are (its workers
    ignore both), so what is tested through the real engine is raysync's side: the version kept at level 1,
    forgotten by raysync's sleep at level 2, and a push to a sleeping engine woken weights first."""
    trainer = ray.remote(num_cpus=0.25)(Policy).remote(seed=9)
    host = fresh_engine()
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        ray.get(trainer.step.remote(1))
        expected = ray.get(trainer.greedy.remote(PROMPTS, TOKENS))
        sync.push(1)
        ray.get(host.__ray_call__.remote(sleep_and_wake, 1))
        assert sync.versions() == [1] and sync.push(1).pairs[0].bytes == 0
        ray.get(host.__ray_call__.remote(sleep_and_wake, 2))
        assert sync.versions() == [None]
        assert sync.push(1).pairs[0].bytes > 0 and sync.versions() == [1]
        ray.get(host.__ray_call__.remote(sleep_only, 2))  # a push reaches the engine while it sleeps
        assert ray.get(host.__ray_call__.remote(is_sleeping)) and sync.versions() == [None]
        assert sync.push(1).pairs[0].bytes > 0
        assert not ray.get(host.__ray_call__.remote(is_sleeping))  # woken: weights, load, KV cache
        assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == expected and sync.versions() == [1]


def test_a_weight_print_sees_writes_replaced_parameters_and_new_gemm_handles():
    """Note [an engine's version and its weights], on a plain torch model standing in for vLLM's."""
    from raysync.engines.vllm_version import WeightPrint

    model = tiny_qwen2(seed=0)
    weights = WeightPrint(model)
    assert weights.matches(model)
    with torch.no_grad():
        model.model.norm.weight.add_(1)  # small: sampled whole
    assert not weights.matches(model)
    weights = WeightPrint(model)
    embed = model.model.embed_tokens.weight
    with torch.no_grad():
        embed.view(-1)[: embed.numel() // 64].zero_()  # the first sampled window of a large tensor
    assert not weights.matches(model)
    weights = WeightPrint(model)
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())  # same bytes
    assert not weights.matches(model)
    layer = model.model.layers[0].mlp.down_proj
    layer.cpu_linear = lambda x, weight, bias: x  # as vLLM's CPU backend keeps a packed weight
    weights = WeightPrint(model)
    assert weights.matches(model)
    layer.cpu_linear = lambda x, weight, bias: x  # a reload makes a new handle
    assert not weights.matches(model)
