"""Validation of a composed configuration, by config group, before anything loads.

``validate`` is the table of contents: one function per group (rollout, loss, precision, trainer, optim, peft, reward
and data, model and evaluation, files, batch tiling, estimator, scheme, process-group timeout, memory plan), each
returning its problems as lines that name the key (and, for a file, the file and the line), so every problem is
reported at once, as verl's per-component ``validate`` does. The schemas themselves (types, defaults) are in
``grail_exp/config.py``; this module checks what types cannot say: ranges, choices from the registries, keys that
must agree, files that must exist and parse. ``validate_eval`` and ``validate_weights`` are the same checks for the
other entry points that load a model (``grail_exp.evaluate``, ``grail_exp.weights``).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from grail_exp.errors import ConfigError

SCHEDULE_UNITS = ("optimizer_step", "rollout_batch")  # optim.schedule_unit
HUB_MODEL_MAX_LR = 1e-5  # above this, a pretrained hub model needs optim.allow_high_lr=true
LORA_LR_FACTOR = 10  # under peft=lora the guard sits this much higher (LoRA's best lr is ~10x full fine-tuning's)
VLLM_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
EXPORT_HF_WEIGHTS = ("final", "every")  # trainer.export_hf_weights


def validate(cfg: DictConfig) -> DictConfig:
    """Reject impossible configurations before anything expensive happens.

    Returns the config with ``estimator`` and ``advantage`` replaced by their typed configs. Raises ``ConfigError``
    listing every problem, each with its full key."""
    e = [*rollout(cfg), *loss(cfg), *precision(cfg), *trainer(cfg), *optim(cfg), *peft(cfg), *reward_and_data(cfg),
         *model_and_evaluation(cfg), *run_metric(cfg), *files(cfg), *batch_tiling(cfg), *estimator(cfg)]
    e += scheme(cfg, retype=not e)
    if not e:  # what needs a well-formed config: the methods' required settings, then the memory plan
        e += required_settings(cfg)
    if not e:
        e += dist_timeout(cfg) + memory_plan(cfg)
    _raise(e)
    return cfg


def _raise(e: list[str], what: str = "configuration") -> None:
    if e:
        raise ConfigError(f"invalid {what}:\n  - " + "\n  - ".join(e))


ROLLOUT_DRAWS = ("multinomial", "inverse_cdf")  # the hf engine's draws (rollout/hf.py DRAWS; a test keeps them equal)


def _check(errors: list[str], ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        errors.append(f"{key} = {value!r}: {why}")


def _one_of(errors: list[str], key: str, value: Any, choices) -> None:
    """The choice check: ``key = value`` must be one of ``choices`` (listed in their order)."""
    _check(errors, value in choices, key, value, f"must be one of: {', '.join(choices)}")


# ---------------------------------------------------------------------------------------------- the groups
def rollout(cfg) -> list[str]:
    """Sampling (``rollout.*``), the sampler/trainer importance-sampling correction and the stale-sampler check."""
    r, e = cfg.rollout, []
    _check(e, r.engine in ("hf", "vllm") or ":" in str(r.engine), "rollout.engine", r.engine,
           "must be one of: hf, vllm, or a plug-in 'package.module:ClassName'")
    _check(e, r.num_generations >= 2, "rollout.num_generations", r.num_generations,
           "must be >= 2 (the group mean is the baseline; one sample has no baseline)")
    _check(e, r.max_completion_length > 0, "rollout.max_completion_length", r.max_completion_length, "must be > 0")
    _check(e, r.temperature > 0, "rollout.temperature", r.temperature, "must be > 0 (training samples)")
    _check(e, 0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    _check(e, r.top_k >= 0, "rollout.top_k", r.top_k, "must be >= 0 (0 disables top-k)")
    _check(e, r.generation_batch_size >= 1, "rollout.generation_batch_size", r.generation_batch_size, "must be >= 1")
    _check(e, r.get("draw", "multinomial") in ROLLOUT_DRAWS, "rollout.draw", r.get("draw"),
           f"must be one of: {', '.join(ROLLOUT_DRAWS)}")
    from grail_exp.loss.correction import MODES as IS_MODES

    ic = r.is_correction
    _one_of(e, "rollout.is_correction.mode", ic.mode, IS_MODES)
    _check(e, ic.clip_max > 0, "rollout.is_correction.clip_max", ic.clip_max, "must be > 0")
    _check(e, ic.clip_min is None or 0 <= ic.clip_min < ic.clip_max, "rollout.is_correction.clip_min", ic.clip_min,
           "must be null or in [0, clip_max)")
    sc = r.sampler_check
    _check(e, sc.max_abs_diff is None or sc.max_abs_diff > 0, "rollout.sampler_check.max_abs_diff", sc.max_abs_diff,
           "must be > 0 or null")
    _check(e, sc.jump_factor is None or sc.jump_factor > 1, "rollout.sampler_check.jump_factor", sc.jump_factor,
           "must be > 1 or null")
    return e + vllm(cfg)


def vllm(cfg) -> list[str]:
    """Impossible ``rollout.vllm`` values (only when ``rollout.engine`` is vllm)."""
    v, r, e = cfg.rollout.get("vllm"), cfg.rollout, []
    if r.engine != "vllm" or v is None:
        return e
    _check(e, 0 < v.gpu_memory_utilization <= 1, "rollout.vllm.gpu_memory_utilization", v.gpu_memory_utilization,
           "must be in (0, 1]")
    _check(e, v.max_model_len is None or v.max_model_len > 0, "rollout.vllm.max_model_len", v.max_model_len,
           "must be > 0 or null")
    _check(e, v.dtype in (None, "float32", "bfloat16", "float16"), "rollout.vllm.dtype", v.dtype,
           "must be null (= model.dtype), float32, bfloat16 or float16")
    _one_of(e, "rollout.vllm.logprobs_mode", v.logprobs_mode, VLLM_LOGPROBS_MODES)
    _check(e, v.get("sync_chunk_mb", 256) >= 1, "rollout.vllm.sync_chunk_mb", v.get("sync_chunk_mb"), "must be >= 1")
    kw = v.get("kwargs") or {}
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        _check(e, int(kw.get(key, 1) or 1) == 1, f"rollout.vllm.kwargs.{key}", kw.get(key),
               "must be 1: the trainer runs one engine per rank, each on its rank's device, inside the job's process "
               "group (vLLM's external launcher); an engine spread over several ranks' devices is not supported")
    _check(e, "distributed_executor_backend" not in kw, "rollout.vllm.kwargs.distributed_executor_backend",
           kw.get("distributed_executor_backend"), "is set by the engine (external_launcher inside a process group, "
           "uniprocess without one): remove it")
    for key, where in (("max_num_batched_tokens", "rollout.vllm.max_num_batched_tokens"),
                       ("max_num_seqs", "rollout.vllm.max_num_seqs"), ("revision", "model.revision"),
                       ("tokenizer_revision", "model.revision")):
        _check(e, key not in kw, f"rollout.vllm.kwargs.{key}", kw.get(key), f"is set from {where}: set that instead")
    tokens, seqs = v.get("max_num_batched_tokens", 4096), v.get("max_num_seqs", 256)
    _check(e, tokens >= 1, "rollout.vllm.max_num_batched_tokens", tokens, "must be >= 1")
    _check(e, seqs >= 1, "rollout.vllm.max_num_seqs", seqs, "must be >= 1")
    _check(e, tokens >= seqs, "rollout.vllm.max_num_batched_tokens", tokens,
           f"must be >= rollout.vllm.max_num_seqs = {seqs} (vLLM schedules at least one token per sequence)")
    e += engine_devices(cfg)
    expandable_segments(cfg)
    if v.max_model_len is not None and "max_completion_length" in r:
        _check(e, v.max_model_len > r.max_completion_length, "rollout.vllm.max_model_len", v.max_model_len,
               f"must exceed rollout.max_completion_length = {r.max_completion_length} (prompt + completion)")
    return e


ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's precedence order


def expandable_segments(cfg, environ=None) -> None:
    """``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) with ``expandable_segments:True`` and a vLLM engine
    colocated on the training GPU is warned about, once, before anything loads. The engine and the trainer share the
    process's CUDA allocator: vLLM's sleep-mode pool cannot use expandable segments (pytorch/pytorch#147851), so vLLM
    rewrites the process's allocator settings around it (older vLLM refuses the combination at start), and the
    colocated layout's memory plan and sleep mode were never measured with it. Warned, not refused: nothing shows that
    a run with it fails."""
    import logging
    import os

    t = cfg.get("trainer")
    if t is None or str(t.get("accelerator", "cpu")) == "cpu" or str(cfg.rollout.engine) != "vllm":
        return
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARIABLES:
        conf = env.get(name)
        if conf:  # torch reads the first one set
            fields = dict(f.strip().partition(":")[::2] for f in conf.split(",") if f.strip())
            if fields.get("expandable_segments", "").strip().lower() in ("true", "1"):
                logging.getLogger("grail_exp").warning(
                    "%s=%s with rollout.engine=vllm colocated on the training GPU: vLLM's sleep-mode memory pool cannot "
                    "use expandable segments (vLLM turns them off around it, older vLLM refuses to start; "
                    "rollout.vllm.sleep_mode=%s) and this layout's memory was never measured with them; unset "
                    "expandable_segments or set it to False", name, conf, cfg.rollout.vllm.sleep_mode)
            return


def engine_devices(cfg) -> list[str]:
    """A colocated vLLM engine on a GPU sits on device ``LOCAL_RANK`` (one per rank; device 0 for a single process),
    while the trainer puts rank i on the i-th entry of a ``trainer.devices`` list: a list is accepted only when the
    two provably agree, i.e. it is 0, 1, ..., n-1 in order. (The engine checks the live devices too:
    ``rollout.vllm.check_engine_device``.)"""
    t = cfg.get("trainer")
    if t is None or str(t.get("accelerator", "cpu")) == "cpu" or str(cfg.rollout.engine) != "vllm":
        return []
    devices = t.get("devices")
    if isinstance(devices, str) and "," in devices:  # Lightning's "0,1" form
        try:
            devices = [int(d) for d in devices.split(",") if d.strip()]
        except ValueError:
            return [f"trainer.devices = {devices!r}: not a list of device indices"]
    if not OmegaConf.is_list(devices) and not isinstance(devices, (list, tuple)):
        return []  # a count (or auto): rank i on device i, as the engine
    listed = [int(d) for d in devices]
    if listed == list(range(len(listed))):
        return []
    i = next(i for i, d in enumerate(listed) if d != i)
    return [f"trainer.devices = {listed}: with rollout.engine=vllm each rank's engine takes device LOCAL_RANK, so rank "
            f"{i} would train on cuda:{listed[i]} but generate on cuda:{i}; set trainer.devices={len(listed)} and choose "
            f"the GPUs with CUDA_VISIBLE_DEVICES={','.join(map(str, listed))}"]


def loss(cfg) -> list[str]:
    """The objective (``loss.*``): names from the loss registries, ranges, the GRPO family's knobs, the loss terms."""
    from grail_exp.loss import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
    from grail_exp.loss.policies import check_family_config

    L, e = cfg.loss, []
    _one_of(e, "loss.scale_rewards", L.scale_rewards, ("group", "batch", "none"))
    _one_of(e, "loss.policy_loss", L.policy_loss, sorted(POLICY_LOSSES))
    _one_of(e, "loss.kl_estimator", L.kl_estimator, sorted(KL_ESTIMATORS))
    e += loss_terms(cfg)
    _check(e, L.epsilon >= 0, "loss.epsilon", L.epsilon, "must be >= 0")
    _check(e, L.epsilon_high is None or L.epsilon_high >= 0, "loss.epsilon_high", L.epsilon_high,
           "must be >= 0 or null")
    _one_of(e, "loss.loss_type", L.loss_type, sorted(AGGREGATIONS))
    _check(e, L.beta >= 0, "loss.beta", L.beta, "must be >= 0")
    _check(e, L.num_iterations >= 1, "loss.num_iterations", L.num_iterations, "must be >= 1")
    return e + check_family_config(cfg)  # also reward.overlong_buffer and rollout.dynamic_sampling


def loss_terms(cfg) -> list[str]:
    """Each auxiliary term of ``loss.terms``: a registered name, its typed schema, then its own checks."""
    from grail_exp.loss import LOSS_TERMS
    from grail_exp.loss.terms import typed_term_config

    terms, e = cfg.loss.get("terms") or {}, []
    for term in terms:
        _check(e, term in LOSS_TERMS, f"loss.terms.{term}", term,
               f"unknown loss term; valid: {', '.join(sorted(LOSS_TERMS)) or 'none registered'}")
        if term not in LOSS_TERMS or terms[term] is None:
            continue
        try:
            typed = typed_term_config(LOSS_TERMS[term], terms[term])
        except Exception as exc:  # noqa: BLE001 - wrong key / type: report it with the others
            e.append(f"loss.terms.{term}: {exc}".split("\n    ")[0])
        else:
            e.extend(f"loss.terms.{term}.{msg}" for msg in LOSS_TERMS[term].check_config(typed))
    return e


def precision(cfg) -> list[str]:
    """Half precision needs fp32 master weights (or a strategy that keeps them): an Adam step of ~lr vanishes in
    bf16 rounding, so the model would silently not train. fp16 needs loss scaling, which is not implemented."""
    from grail_exp.compute.logprobs import LOGPROB_DTYPES
    from grail_exp.training.backends import BACKENDS

    m, o, t, e = cfg.model, cfg.optim, cfg.trainer, []
    backend = BACKENDS.get(str(t.strategy))
    sharded = backend is not None and backend.owns_master_weights  # FSDP / ZeRO keep the fp32 masters themselves
    from grail_exp.models import lora

    # under peft=lora only the adapters train, and they are fp32 whatever model.dtype is
    if m.dtype in ("bfloat16", "float16") and o.master_weights is False and not sharded and not lora.enabled(cfg):
        e.append(f"model.dtype = {m.dtype!r} with optim.master_weights = false: AdamW would update "
                 f"{m.dtype} weights in place and steps of lr = {o.lr} vanish in rounding; set "
                 "optim.master_weights=true (fp32 masters) or null, or use trainer=fsdp / fsdp_zero2 / deepspeed_zero2")
    _check(e, m.dtype != "float16", "model.dtype", m.dtype,
           "float16 training needs loss scaling, which is not implemented; use bfloat16 (evaluation may use float16)")
    _one_of(e, "trainer.logprob_dtype", t.logprob_dtype, LOGPROB_DTYPES)
    return e


def trainer(cfg) -> list[str]:
    """The trainer's counts and switches (``trainer.*``) and its update backend's own layout checks."""
    from grail_exp.training.backends import BACKENDS

    t, e = cfg.trainer, []
    backend = BACKENDS.get(str(t.strategy))
    if backend is None:
        e.append(f"trainer.strategy = {t.strategy!r}: must be one of {', '.join(sorted(BACKENDS))} (the update "
                 "backends in grail_exp/training/backends; DeepSpeed runs as 'deepspeed', trainer=deepspeed_zero2, "
                 "under this trainer's own step: Lightning's DeepSpeed strategies own the step and do not fit it)")
    else:
        e.extend(backend.check_config(cfg))
    for key, low in (("max_steps", 1), ("prompts_per_step", 1), ("micro_batch_size", 1), ("logprob_chunk_tokens", 1),
                     ("checkpoint_every", 0), ("weights_table_every", 0), ("max_nonfinite_in_a_row", 1),
                     ("eval_every", 0), ("backward_heap_returns", 0)):
        _check(e, t[key] >= low, f"trainer.{key}", t[key], f"must be >= {low}")
    _check(e, t.get("save_weights_only_every", 0) >= 0, "trainer.save_weights_only_every",
           t.get("save_weights_only_every"), "must be >= 0 (0 = no trajectory)")
    _check(e, t.keep_last_checkpoints is None or t.keep_last_checkpoints >= 1, "trainer.keep_last_checkpoints",
           t.keep_last_checkpoints, "must be >= 1 or null")
    _check(e, t.get("export_hf_weights", "final") in EXPORT_HF_WEIGHTS, "trainer.export_hf_weights",
           t.get("export_hf_weights"), "must be final (the full Hugging Face weights in the final checkpoint only) or "
           "every (in every checkpoint); resume reads the shards either way")
    share = t.get("share_prompts", "auto")
    _check(e, t.get("share_prompt_prefix", "auto") in ("auto", True, False), "trainer.share_prompt_prefix",
           t.get("share_prompt_prefix"), "must be auto, true or false")
    _check(e, share in ("auto", True, False), "trainer.share_prompts", share, "must be auto, true or false")
    _check(e, not (share is True and cfg.model.gradient_checkpointing), "trainer.share_prompts", share,
           "cannot be true with model.gradient_checkpointing=true (a layer replayed in the backward has no cache of "
           "the shared prompt); set it to auto or false")
    timeout = t.get("dist_timeout_s")
    _check(e, timeout is None or timeout > 0, "trainer.dist_timeout_s", timeout,
           "must be > 0 seconds, or null for what the planned checkpoint write needs (python -m grail_exp.plan)")
    rendezvous = t.get("rendezvous_timeout_s", 600)
    _check(e, rendezvous is not None and rendezvous > 0, "trainer.rendezvous_timeout_s", rendezvous,
           "must be > 0 seconds: how long the ranks that arrived wait for the others when the process group forms")
    _check(e, not cfg.study.dir or t.eval_at_end, "trainer.eval_at_end", t.eval_at_end,
           f"must be true in a study (study.dir={cfg.study.dir}): each arm is recorded with its final evaluation")
    return e


def optim(cfg) -> list[str]:
    """The optimiser (``optim.*``), and the guard against demo learning rates on pretrained hub models (10x higher
    under LoRA, whose best rate is ~10x full fine-tuning's: grail_exp/config.py ``PeftConfig``)."""
    from grail_exp.models import lora

    o, e = cfg.optim, []
    _check(e, o.lr > 0, "optim.lr", o.lr, "must be > 0")
    limit = HUB_MODEL_MAX_LR * (LORA_LR_FACTOR if lora.enabled(cfg) else 1)
    if o.lr > limit and is_hub_model(cfg.model) and not o.get("allow_high_lr", False):
        recipe = (cfg.get("recipe") or {}).get("name", "?")
        e.append(f"optim.lr = {o.lr!r}: above {limit:g} for the pretrained model {cfg.model.name_or_path!r} "
                 f"(recipe {recipe}); rates like the demo's 1e-4 destroy 4-8B weights within tens of steps (the paper: "
                 "1e-6, recipe=paper; under peft=lora ~10x that). Set optim.allow_high_lr=true if you mean it")
    _check(e, o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _check(e, o.get("schedule_unit", "optimizer_step") in SCHEDULE_UNITS, "optim.schedule_unit",
           o.get("schedule_unit"), f"must be one of: {', '.join(SCHEDULE_UNITS)}")
    _check(e, o.max_grad_norm is None or o.max_grad_norm > 0, "optim.max_grad_norm", o.max_grad_norm,
           "must be > 0 or null")
    return e


def peft(cfg) -> list[str]:
    """LoRA (``peft.*``): rank, alpha, dropout, target modules and sync mode, and what the rollout engine can serve
    (grail_exp/models/lora.py ``check_config``)."""
    from grail_exp.models import lora
    from grail_exp.training.backends import BACKENDS

    e = lora.check_config(cfg)
    backend = BACKENDS.get(str((cfg.get("trainer") or {}).get("strategy", "auto")))
    if lora.enabled(cfg) and str(cfg.rollout.engine) == "hf" and str(cfg.peft.sync) == "merged" \
            and backend is not None and backend.shards_parameters:
        e.append(f"peft.sync = merged: rollout=hf swaps a merged copy into the policy's own layers, which "
                 f"trainer.strategy = {cfg.trainer.strategy} holds as shards; use peft.sync=adapter (the HF engine then "
                 "samples the live adapters) or rollout=vllm")
    return e


def is_hub_model(model_cfg) -> bool:
    """A pretrained model loaded from the Hugging Face hub by id: not the embedded model (name_or_path null), not
    random weights (model.random_init), not a local directory, not a packaged model (``pkg:...``)."""
    name = model_cfg.get("name_or_path")
    if name is None or model_cfg.get("random_init"):
        return False
    from grail_exp.models.loading import looks_local

    return ":" not in str(name) and not looks_local(str(name))


def reward_and_data(cfg) -> list[str]:
    """Grading (``reward.*``), the training data (``data.*``) and the supervised cold start that learns from it."""
    from grail_exp.data import DATASETS

    rw, d, e = cfg.reward, cfg.data, []
    _check(e, rw.num_workers >= 0, "reward.num_workers", rw.num_workers, "must be >= 0")
    _check(e, rw.hard_timeout_s > 0, "reward.hard_timeout_s", rw.hard_timeout_s, "must be > 0")
    e += extraction(rw, "reward.extraction")
    order = d.get("order", "shuffled")
    _one_of(e, "data.order", order, ("shuffled", "reference"))
    _check(e, order == "shuffled" or d.name != "arithmetic", "data.order", order,
           "reference is the order of a hub dataset (data=deepmath); the arithmetic stream is generated")
    _one_of(e, "data.name", d.name, sorted(DATASETS))
    if d.name == "arithmetic":  # the knobs must allow the fixed splits: say so before any model is built
        from grail_exp.data.sources import arithmetic_task

        try:
            task = arithmetic_task(d)
            task.split("validation"), task.split("test")  # cached: training and evaluation reuse them
        except ConfigError as exc:
            e.append(str(exc))
    cs = cfg.model.get("cold_start")
    if cs is not None and cs.enabled:
        _check(e, d.name == "arithmetic", "model.cold_start.enabled", True,
               f"the cold start learns the arithmetic task's own solutions; data.name is {d.name!r}")
        for key in ("steps", "batch_size"):
            _check(e, cs[key] >= 1, f"model.cold_start.{key}", cs[key], "must be >= 1")
        _check(e, cs.lr > 0, "model.cold_start.lr", cs.lr, "must be > 0")
    return e


def extraction(node, key: str) -> list[str]:
    from grail_exp.grading.extraction import MODES

    mode, e = node.get("extraction", "last_balanced"), []
    _one_of(e, key, mode, MODES)
    return e


def model_and_evaluation(cfg) -> list[str]:
    """The model's keys and the evaluation (``eval.*``, ``benchmark.*``): shared by training and evaluate."""
    from grail_exp.data import BENCHMARKS
    from grail_exp.models.architectures import check_model_config
    from grail_exp.models.packaged import check_spec as check_packaged_model

    ev, m, b, e = cfg.eval, cfg.model, cfg.benchmark, []
    _check(e, ev.n >= 1, "eval.n", ev.n, "must be >= 1")
    _check(e, ev.temperature >= 0, "eval.temperature", ev.temperature, "must be >= 0 (0 = greedy)")
    _check(e, ev.temperature > 0 or ev.n == 1, "eval.n", ev.n, "greedy evaluation (eval.temperature=0) needs n=1")
    _check(e, 0 < ev.top_p <= 1, "eval.top_p", ev.top_p, "must be in (0, 1]")
    _check(e, ev.max_tokens > 0, "eval.max_tokens", ev.max_tokens, "must be > 0")
    _check(e, ev.n < 1 or (ev.batch_size >= ev.n and ev.batch_size % ev.n == 0), "eval.batch_size", ev.batch_size,
           f"must be a positive multiple of eval.n = {ev.n}: one generate() call (a chunk, the unit the ranks share "
           "and the cache keeps) holds whole problems, eval.batch_size / eval.n of them")
    _check(e, b.limit is None or b.limit >= 1, "benchmark.limit", b.limit, "must be >= 1 or null")
    _one_of(e, "model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    _one_of(e, "model.prompt_style", m.prompt_style, ("chat", "plain"))
    _check(e, m.cpu_explicit_attention_max_scores >= 0, "model.cpu_explicit_attention_max_scores",
           m.cpu_explicit_attention_max_scores, "must be >= 0 (0 = always the fused attention kernel)")
    _one_of(e, "logger.name", cfg.logger.name, ("mlflow", "none"))
    e += check_model_config(m) + check_packaged_model(m.name_or_path)  # random_init / tokenizer keys; pkg:<name>
    for i, ex in enumerate(m.get("few_shot") or []):
        _check(e, hasattr(ex, "keys") and {"question", "answer"} <= set(ex.keys()), f"model.few_shot[{i}]", ex,
               "must be a mapping with 'question' and 'answer'")
    if m.name_or_path is None and not m.get("random_init"):
        _check(e, m.build is not None, "model.build", None,
               "model.name_or_path is null, so the embedded model is built, which needs model.build")
    _check(e, b.get("olympiad_gold", "first") in ("first", "str"), "benchmark.olympiad_gold", b.get("olympiad_gold"),
           "must be first (final_answer[0]) or str (the paper's str(final_answer))")
    _check(e, len(b.names) > 0, "benchmark.names", list(b.names), "must name a benchmark")
    e += extraction(b, "benchmark.extraction")
    for name in b.names:
        _check(e, name in BENCHMARKS, "benchmark.names", name,
               f"unknown benchmark; valid: {', '.join(sorted(BENCHMARKS))}")
    return e


def run_metric(cfg) -> list[str]:
    """``optimized_metric``, the value a run returns to sweeps and Optuna: a metric the final evaluation logs."""
    m, e = cfg.get("optimized_metric"), []
    if m:
        parts = str(m).split("/")
        ok = len(parts) == 3 and parts[0] == "eval" and parts[1] in [*cfg.benchmark.names, "avg", "avg_weighted"] and (
            parts[2] in ("acc", "maj", "nulls", "truncation_rate", "mean_tokens") or parts[2].startswith("pass_at_"))
        _check(e, ok, "optimized_metric", m, "must be eval/<benchmark|avg|avg_weighted>/<acc|maj|pass_at_k|...> "
               f"for a benchmark in benchmark.names ({', '.join(cfg.benchmark.names)})")
    return e


def files(cfg) -> list[str]:
    """Every file the config names, before anything loads (a missing training file used to surface only after
    minutes of building the starting model): the training data, the model's local files, the benchmark files and
    the checkpoint to resume. One line per problem, naming the key, the file and, for a malformed row, its line."""
    from grail_exp.checkpoint import check_resume
    from grail_exp.data import DATASET_FILE_CHECKS

    check_data = DATASET_FILE_CHECKS.get(str(cfg.data.name))
    return [*(check_data(cfg.data) if check_data else []), *model_and_benchmark_files(cfg),
            *check_resume(cfg.get("resume"))]


def model_and_benchmark_files(cfg) -> list[str]:
    from grail_exp.data.benchmarks import check_benchmark_files
    from grail_exp.models.loading import check_local_files

    return check_local_files(cfg.model) + check_benchmark_files(cfg)


def batch_tiling(cfg) -> list[str]:
    """Every rank samples whole groups, mini-batches hold whole groups, and micro-batches tile a mini-batch exactly
    (otherwise gradient accumulation is ill-defined)."""
    from grail_exp.world import configured_world_size

    t, e = cfg.trainer, []
    world, k = configured_world_size(t), t.mini_batches_per_rollout
    _check(e, t.prompts_per_step % world == 0, "trainer.prompts_per_step", t.prompts_per_step,
           f"must be divisible by the data-parallel world size trainer.devices x trainer.num_nodes = {world} "
           "(every rank samples whole groups)")
    _check(e, k >= 1, "trainer.mini_batches_per_rollout", k, "must be >= 1")
    prompts_per_rank = t.prompts_per_step // world
    if k >= 1 and prompts_per_rank % k:
        e.append(f"trainer.mini_batches_per_rollout = {k}: must divide the prompts of a rank's rollout batch "
                 f"(trainer.prompts_per_step / world size = {prompts_per_rank}): a mini-batch holds whole groups")
    completions = t.prompts_per_step * cfg.rollout.num_generations // world // max(1, k)  # per rank and mini-batch
    if completions >= 1 and t.micro_batch_size >= 1 and completions % min(t.micro_batch_size, completions):
        e.append(f"trainer.micro_batch_size = {t.micro_batch_size}: must divide trainer.prompts_per_step x "
                 f"rollout.num_generations / world size / trainer.mini_batches_per_rollout = {completions}")
    return e


def estimator(cfg) -> list[str]:
    """The sequence-advantage estimator: a registered name, its typed schema and its own checks. Types
    ``cfg.estimator`` (the registry's dataclass) when the node merges into it."""
    from grail_exp.estimators import ESTIMATORS

    est, e = cfg.get("estimator"), []
    name = est.get("name") if isinstance(est, DictConfig) else None
    if name not in ESTIMATORS:
        return [f"estimator.name = {name!r}: unknown estimator; valid: {', '.join(sorted(ESTIMATORS))}"]
    spec = ESTIMATORS[name]
    try:
        typed = OmegaConf.merge(OmegaConf.structured(spec.config_class), est)
    except Exception as exc:  # noqa: BLE001 - omegaconf names the offending key
        return [f"estimator: {exc}".split("\n    ")[0]]
    e.extend(f"estimator.{msg}" for msg in (spec.check(typed) if spec.check else []))
    e.extend(spec.check_run(typed, cfg) if spec.check_run else [])
    ds = cfg.rollout.get("dynamic_sampling")
    if ds is not None and ds.enabled and spec.prompt_variants is not None:
        e.append(f"rollout.dynamic_sampling.enabled = true: not with estimator={name} (it plans its own "
                 "prompts per problem and replaces the rewards dynamic sampling filters on)")
    with open_dict(cfg):
        cfg.estimator = typed
    return e


def scheme(cfg, retype: bool) -> list[str]:
    """The token-weight scheme (``advantage``): a registered name, its typed schema and its own checks. Types
    ``cfg.advantage`` when ``retype`` (no problem elsewhere) and it has none of its own."""
    from grail_exp.advantages import SCHEMES, scheme_config_class

    adv = cfg.advantage
    name = adv.get("name") if isinstance(adv, DictConfig) else None
    if name not in SCHEMES:
        return [f"advantage.name = {name!r}: unknown scheme; valid: {', '.join(sorted(SCHEMES))}"]
    try:
        typed = OmegaConf.merge(OmegaConf.structured(scheme_config_class(name)), adv)
    except Exception as exc:  # noqa: BLE001 - omegaconf names the offending key
        return [f"advantage: {exc}".split("\n    ")[0]]
    e = [f"advantage.{msg}" for msg in SCHEMES[name].check_config(typed)]
    if retype and not e:
        with open_dict(cfg):
            cfg.advantage = typed
    return e


def required_settings(cfg: DictConfig) -> list[str]:
    """A method's required settings (``requires`` of the chosen estimator, scheme and loss terms: {key: value}) must
    hold in the composed run. Its config-group file sets them, and the root defaults list composes the method groups
    after the recipe family (conf/config.yaml), so a family recipe cannot undo them; an experiment file or an override
    that sets another value is refused here, naming the key, instead of silently running another objective."""
    from grail_exp.advantages import SCHEMES
    from grail_exp.estimators import ESTIMATORS
    from grail_exp.loss import LOSS_TERMS

    methods = [(f"estimator={cfg.estimator.name}", ESTIMATORS[cfg.estimator.name].requires),
               (f"advantage={cfg.advantage.name}", SCHEMES[cfg.advantage.name].requires)]
    methods += [(f"loss term {name}", LOSS_TERMS[name].requires) for name in (cfg.loss.get("terms") or {})
                if name in LOSS_TERMS]
    e = []
    for method, requires in methods:
        for key, want in requires.items():
            got = OmegaConf.select(cfg, key)
            if got != want:
                e.append(f"{key} = {got!r}: {method} requires {key}={want} (the method's definition); a recipe, "
                         "experiment file or override set another value. Remove that setting or choose another method")
    return e


def dist_timeout(cfg) -> list[str]:
    """An explicit ``trainer.dist_timeout_s`` below what the planned checkpoint write needs is warned about, not
    refused: the need assumes a slow shared filesystem (memory.needed_dist_timeout), and storage several times faster
    makes a shorter timeout right. A single rank never waits for another: no timeout to judge."""
    from grail_exp.memory import needed_dist_timeout
    from grail_exp.world import configured_world_size

    t = cfg.trainer
    if t.get("dist_timeout_s") is None or configured_world_size(t) < 2:
        return []
    need, how = needed_dist_timeout(cfg)
    if t.dist_timeout_s < need:
        import logging

        logging.getLogger("grail_exp").warning(
            "trainer.dist_timeout_s = %s is below the %d s the planned checkpoint write needs (%s): a rank waiting "
            "that long in a collective aborts the run; raise it unless the checkpoint storage is faster",
            t.dist_timeout_s, need, how)
    return []


def memory_plan(cfg) -> list[str]:
    """The memory plan of a valid config, before any model is loaded (grail_exp/memory/): refused when it does
    not fit a device it knows."""
    from grail_exp.memory import check as check_memory_plan

    refusal = check_memory_plan(cfg)
    return [refusal] if refusal else []


# ---------------------------------------------------------------------------------------------- other entry points
def validate_eval(cfg: DictConfig) -> DictConfig:
    """Validation for ``python -m grail_exp.evaluate`` (before any model is loaded)."""
    e: list[str] = []
    _one_of(e, "rollout.engine", cfg.rollout.engine, ("hf", "vllm"))
    _check(e, cfg.reward.hard_timeout_s > 0, "reward.hard_timeout_s", cfg.reward.hard_timeout_s, "must be > 0")
    _raise([*e, *vllm(cfg), *model_and_evaluation(cfg), *model_and_benchmark_files(cfg)])
    return cfg


def validate_weights(cfg: DictConfig) -> DictConfig:
    """Validation for ``python -m grail_exp.weights``: the rollouts file and the model's files, before the model
    (perhaps a warm start to build) loads. The rows' token ids are checked against the tokenizer when it is loaded."""
    from pathlib import Path

    from grail_exp.data.jsonl import iter_jsonl_objects
    from grail_exp.models.loading import check_local_files

    e, path = check_local_files(cfg.model), Path(str(cfg.input)).expanduser()
    if not path.is_file():
        e.append(f"input = {str(cfg.input)!r}: no such file (a JSONL of rollouts)")
    else:
        try:
            rows = sum(1 for _ in iter_jsonl_objects(path, ValueError))
            _check(e, rows > 0, "input", str(cfg.input), f"{path}: no rows")
        except ValueError as exc:
            e.append(f"input = {str(cfg.input)!r}: {exc}")
    _raise(e)
    return cfg


def validate_preflight(opts) -> None:
    """The ``preflight.*`` keys of ``python -m grail_exp.preflight`` (grail_exp/config.py ``PreflightConfig``)."""
    e: list[str] = []
    _check(e, opts.layers is None or opts.layers >= 1, "preflight.layers", opts.layers, "must be >= 1 or null")
    _check(e, opts.rounds >= 1, "preflight.rounds", opts.rounds, "must be >= 1")
    _check(e, opts.stop_rank >= 0, "preflight.stop_rank", opts.stop_rank, "must be >= 0")
    _check(e, opts.stop_timeout_s > 0, "preflight.stop_timeout_s", opts.stop_timeout_s, "must be > 0")
    _check(e, opts.run_timeout_s > 0, "preflight.run_timeout_s", opts.run_timeout_s, "must be > 0")
    _check(e, opts.eval_limit is None or opts.eval_limit >= 1, "preflight.eval_limit", opts.eval_limit,
           "must be >= 1 or null")
    _check(e, opts.logprob_tolerance is None or opts.logprob_tolerance > 0, "preflight.logprob_tolerance",
           opts.logprob_tolerance, "must be > 0 or null")
    _raise(e, "preflight options")
