"""The trainer's LoRA adapter inside a colocated vLLM engine (``peft=lora``, ``peft.sync=adapter``; docs/lora.md).

The engine holds the frozen base (pushed once, ``UpdateBackend.sync_engine``) and one adapter slot. Each sync
replaces the adapter with the policy's current one under a **new name and id per version** (``policy-v<n>``): vLLM
keys its prefix cache by the adapter's name and path (``v1/core/kv_cache_utils.py``), so a reused name could serve a
prompt's KV computed under the previous policy (the reason for TRL's versioned adapter names); the previous version
is removed first, so the engine never holds two.

How the tensors get there. vLLM 0.32 / 0.33 have no tensor-backed ``LoRARequest``: a request names a folder, read
when the adapter is first used. The engine the trainer builds runs in this process (``engine_in_process``), so the
adapter's tensors are handed to the worker directly (``collective_rpc`` with ``register_in_worker``): vLLM's own
``LoRAModel.from_lora_tensors``, validated against the engine's ``LoRAConfig`` as its folder loader validates, then
registered with the worker's adapter manager, where a request of that id finds it loaded and never reads its
path. The worker gets copies: vLLM scales B in place when it registers an adapter, which in process would scale the
trainer's own parameter. Nothing is serialised, written or read back (verl's ``TensorLoRARequest`` does the same by subclassing the
request). An engine in another process (or a vLLM without that worker layout) gets a PEFT adapter folder written
into a private temporary directory and the public ``add_lora``: the same tensors, exact either way.

``engine_kwargs``: ``enable_lora`` with the smallest ``max_lora_rank`` vLLM allows that holds ``peft.rank``, one slot
(``max_loras = max_cpu_loras = 1``: the trainer serves one policy).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

VERSION_PREFIX = "policy-v"  # the adapter's name in the engine: policy-v1, policy-v2, ...


def engine_kwargs(rank: int) -> dict:
    """``vllm.LLM`` arguments that give the engine one LoRA slot able to hold a rank-``rank`` adapter."""
    from grail_exp.models.lora import engine_max_rank

    return {"enable_lora": True, "max_lora_rank": engine_max_rank(int(rank)), "max_loras": 1, "max_cpu_loras": 1}


def register_in_worker(worker, tensors: dict, config: dict, lora_id: int, previous: int | None) -> list[int]:
    """Runs inside the vLLM worker: drop adapter ``previous``, build adapter ``lora_id`` from ``tensors`` (PEFT's
    names) and ``config`` (its ``adapter_config.json``) as vLLM's folder loader does, register it; returns the ids
    now registered."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # LRUCacheWorkerLoRAManager
    adapters = manager._adapter_manager
    if previous is not None:
        adapters.remove_adapter(previous)
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(manager.lora_config)  # rank <= max_lora_rank, no bias: as for a folder
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    adapters.add_adapter(lora)
    return sorted(adapters.list_adapters())


class AdapterVersions:
    """The engine's adapter, one version at a time: ``push`` registers the policy's adapter under the next version
    and returns the ``LoRARequest`` generation passes; ``loaded`` says which ids the engine holds."""

    def __init__(self, llm, in_process: bool):
        self.llm = llm
        self.in_memory = in_process  # the tensors handed over directly (module docstring)
        self.version = 0
        self.request = None
        self._dir: Path | None = None  # the folder route's private directory

    def push(self, tensors: dict, config: dict):
        from vllm.lora.request import LoRARequest

        previous = self.request.lora_int_id if self.request is not None else None
        self.version += 1
        name = f"{VERSION_PREFIX}{self.version}"
        if self.in_memory:
            # Copies: vLLM folds the scaling into B in place (LoRAModel.optimize), and in process it would be handed
            # the trainer's own tensors (an fp32 CPU parameter's .float().cpu() is itself).
            tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
            try:
                self.llm.collective_rpc(register_in_worker, args=(tensors, config, self.version, previous))
                self.request = LoRARequest(name, self.version, f"memory://{name}")  # its path is never read
                return self.request
            except AttributeError as exc:  # another vLLM's worker layout: the folder route below
                log.warning("vLLM's worker has no LoRA manager where this vLLM version keeps it (%s): the adapter "
                            "goes through a folder from now on", exc)
                self.in_memory = False
        return self._push_folder(name, tensors, config, previous)

    def _push_folder(self, name: str, tensors: dict, config: dict, previous: int | None):
        from vllm.lora.request import LoRARequest

        from grail_exp.models.lora import write_adapter

        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="grail_vllm_adapter_"))
        folder = self._dir / name
        write_adapter(folder, tensors, config)
        engine = self.llm.llm_engine
        if previous is not None:
            engine.remove_lora(previous)
            shutil.rmtree(self._dir / f"{VERSION_PREFIX}{previous}", ignore_errors=True)
        self.request = LoRARequest(name, self.version, str(folder))
        engine.add_lora(self.request)  # read and validated now, not at the first generation
        return self.request

    def loaded(self) -> set[int]:
        """The adapter ids the engine holds (its own list)."""
        return set(self.llm.llm_engine.list_loras())

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
