"""Structured configs: the typed schemas of the Hydra tree in ``conf/``.

Every YAML file under ``conf/`` is merged into these dataclasses, so a misspelt key or a value of the
wrong type fails at composition time, naming the key. ``grail_exp/validate.py`` then checks what types cannot
express (ranges, cross-field constraints, files) *before* any model is loaded, and reports every problem at
once, each with its full key. The schemas of the report
(``grail_exp.reporting.schema``) and ``grail_exp.extrapolate`` live beside their own validators, in those modules.

Each field carries a one-line comment: what it does, its default, and where it comes from
(paper and section, or the TRL option it mirrors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from grail_exp.errors import ConfigError  # noqa: F401  (re-exported: `from grail_exp.config import ConfigError`)


# ---------------------------------------------------------------------------------------------- model
@dataclass
class BuildConfig:
    """Shape of the embedded model built locally (only used when ``model.name_or_path`` is null)."""

    architecture: str = "qwen3"  # qwen3 | llama: the transformers architecture to instantiate
    tokenizer: str = "qwen"  # qwen (byte-level BPE, ChatML) | llama (metaspace BPE, byte fallback, header tokens)
    vocab_size: int = 320  # BPE target size; digits stay single tokens regardless
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    seed: int = 0  # init + warm-start seed; independent of the run seed so a seed sweep shares one start


@dataclass
class WarmStartConfig:
    """Supervised warm start of the embedded model (demo-notes: stop at a target accuracy, not a step count)."""

    enabled: bool = True
    lr: float = 3e-3
    batch_size: int = 64
    warmup_steps: int = 20
    max_steps: int = 3000  # safety cap; the target is normally reached first
    eval_every: int = 50
    eval_problems: int = 128  # validation problems graded greedily at each check
    target_accuracy: float = 0.35  # stop at the first check at or above this greedy accuracy
    # SCRL (estimator=scrl sets these): a fraction of each SFT batch in the curriculum format, so the model answers
    # both prompt formats (grail_exp/data/curriculum.py). 0 = off (the cache key then ignores these keys).
    curriculum_fraction: float = 0.0
    curriculum_prompt_template: str | None = None  # t_K(x) as in estimator.prompt_template
    curriculum_subproblem_template: str | None = None  # as estimator.subproblem_template


@dataclass
class ColdStartConfig:
    """A supervised cold start on the arithmetic task's own chain solutions, built once and cached
    (grail_exp/models/cold_start.py); the real-model study's starting weights (conf/recipe/smollm2_chain/base.yaml)."""

    enabled: bool = False
    steps: int = 40  # AdamW steps
    batch_size: int = 8  # problems per step
    lr: float = 1.0e-4
    seed: int = 0  # of the update (the problems are fixed by data.seed and first_index)
    first_index: int = 20_000_000  # where in the task's training stream its problems start (RL reads it from 0)


@dataclass
class ModelConfig:
    """Policy model: a hub id / local directory, or (name_or_path: null) the embedded model."""

    name: str = MISSING  # short name used in run names and tables
    name_or_path: str | None = None  # hub id or local HF directory; null -> build the embedded model
    revision: str | None = None  # hub revision (commit sha or tag); pin it for reproductions
    dtype: str = "float32"  # float32 | bfloat16 | float16
    attn_implementation: str | None = None  # eager | sdpa | flash_attention_2; null = transformers default
    # sdpa on CPU under autograd: up to this many query x key positions per head, two products and a float32 softmax
    # instead of the fused kernel (grail_exp/compute/attention.py, whose DEFAULT_MAX_SCORES says why this value); 0 =
    # always the fused kernel
    cpu_explicit_attention_max_scores: int = 20_000
    trust_remote_code: bool = False  # never execute code from a model repo unless you say so
    gradient_checkpointing: bool = False
    # Prompting (how a problem becomes the model's input; recorded with every table)
    prompt_style: str = "chat"  # chat: the tokenizer's chat template | plain: "Question: ...\nAnswer:" text
    chat_template: str | None = None  # Jinja override for tokenizers without a (suitable) template
    chat_template_kwargs: dict = field(default_factory=lambda: {"enable_thinking": False})  # Qwen3 non-thinking mode
    plain_template: str = "Question: {problem}\nAnswer:"  # prompt_style=plain (base models)
    system_prompt: str | None = None  # null = no system turn of ours (as in the GRAIL paper); a template may add its own default (SmolLM2 does)
    # worked examples [{question, answer}] before the problem (chat: earlier turns); [] = zero-shot (paper)
    few_shot: list = field(default_factory=list)
    strip_think: bool = False  # grade only the text after the last </think> (thinking models, e.g. R1-Distill)
    # Random weights with the real architecture, offline (benchmarks, GPU smoke tests; grail_exp/models/architectures.py)
    random_init: bool = False  # true: build the architecture with seeded random weights; never touches the hub
    # shipped name (grail_exp/data/architectures/<name>.json) or a config.json path; null = the shipped one whose hub id
    # is name_or_path
    architecture: str | None = None
    random_init_overrides: Any = None  # config.json keys to change, e.g. {num_hidden_layers: 2}; null = none
    init_seed: int = 0  # seed of the random weights (independent of the run seed)
    # null = the model's (random_init: the architecture's packaged one) | dir | hub id | pkg:qwen3 | pkg:llama3 |
    # pkg:r1_distill_llama
    tokenizer_name_or_path: str | None = None
    # Embedded model only
    # load the packaged warm-started model when model.build/warm_start/data match its build exactly
    # (docs/embedded-model.md); false = always build locally
    shipped_weights: bool = True
    build: BuildConfig | None = None
    warm_start: WarmStartConfig | None = None
    # Any model: a supervised cold start on the task's solutions before RL (cached; grail_exp/models/cold_start.py)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)


@dataclass
class RecipeConfig:
    """Which recipe composed the run, recorded with it (conf/recipe/<family>/, docs/recipes-card.md). A model config
    declares its family (`- override /recipe@_global_.recipe: paper` in its defaults list); ``recipe=<family>`` on the
    command line wins. The family's base file sets these keys."""

    name: str = "demo"  # the family: demo (embedded models) | paper (the GRAIL paper's, its five models) | smollm2 | baselines | none
    base: str | None = None  # the family's file, conf/recipe/<family>/base.yaml: its groups (data, benchmark, rollout, eval, trainer) and keys
    scheme: str | None = None  # the scheme's part composed after it (conf/recipe/<family>/<advantage>.yaml); null = none
    batch_sizes: dict = field(default_factory=dict)  # paper: per-engine per-rank generate()/eval rows {hf: {rollout, eval}, vllm: ...}


# ---------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Training prompts. ``name`` selects a dataset from the registry in ``grail_exp/data``."""

    name: str = MISSING  # arithmetic (generated) | deepmath (trl-lib/DeepMath-103K)
    instruction: str = ""  # appended to every problem; the paper uses " Please reason step by step, ..."
    # arithmetic: difficulty knobs (see grail_exp/data/arithmetic.py)
    min_steps: int = 2
    max_steps: int = 3
    max_operand: int = 99
    operators: str = "+-"
    allow_negative: bool = False
    seed: int = 1234  # data seed: fixed validation/test splits, independent of the run seed
    num_validation: int = 256
    num_test: int = 256
    train_seed: int | None = None  # the training stream's order alone (e.g. ${seed}); null = data.seed
    solution_style: str = "compact"  # compact | steps | words: how reference solutions write the chain
    # hub datasets
    path: str | None = None  # hub id or local dir/file for `datasets.load_dataset`
    revision: str | None = None
    split: str = "train"
    problem_field: str = "prompt"
    answer_field: str = "solution"
    shuffle_seed: int = 42  # the paper shuffles DeepMath with seed 42
    num_subproblems: int | None = None  # scrl_jsonl: K subproblems required per line (paper: 4); null = any
    # Prompt order of hub datasets. shuffled: one datasets.shuffle(shuffle_seed), then cycled (default) |
    # reference: the GRAIL reference's stream, i.e. that shuffle, then TRL's RepeatSampler permutation
    # torch.randperm(n, generator seeded sampler_seed) per epoch of floor(n / P) * P prompts (P = prompts_per_step).
    order: str = "shuffled"
    sampler_seed: int | None = None  # order=reference: the permutation's seed; null = the run seed, as the reference


# ---------------------------------------------------------------------------------------------- rollout / eval
@dataclass
class ISCorrectionConfig:
    """Truncated importance sampling of the sampler/trainer mismatch (grail_exp/loss/correction.py)."""

    # none | token_truncate (TIS) | token_mask (IcePop) | sequence_truncate | sequence_mask (TRL's / verl's modes).
    # Off for rollout=hf (the sampler is the policy); token_truncate at 2 for rollout=vllm (the TIS blog's; TRL's
    # default is sequence_mask at 3, verl's is off); sequence_mask at 3 for rollout=vllm_paper (TRL, the reference).
    mode: str = "none"
    clip_min: float | None = None  # C_min: lower bound of the ratio (null: none for truncation, 0 for masks)
    clip_max: float = 2.0  # C_max: upper cap (TIS blog: 2; TRL's vllm_importance_sampling_clip_max: 3)


@dataclass
class SamplerCheckConfig:
    """Fail loudly when the rollout engine stops sampling from the trained weights (stale vLLM sync)."""

    max_abs_diff: float | None = 1.0  # abort when mean |logp_trainer - logp_sampler| exceeds this (nats); null = off
    jump_factor: float | None = 10.0  # abort when it exceeds this multiple of its running median; null = off
    min_diff: float = 0.02  # floor of that median (an exact engine's ~1e-7 must not make noise an alarm)
    warmup_steps: int = 3  # steps of history before the jump check starts


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2; verl algorithm.filter_groups): drop groups whose rewards are all
    equal (no gradient signal) and sample more prompts until the step has trainer.prompts_per_step informative groups."""

    enabled: bool = False  # off = every sampled group is trained on (GRPO)
    # extra generation rounds per step at most (verl max_num_gen_batches); then the batch is topped up with dropped
    # groups (logged)
    max_extra_rounds: int = 4


@dataclass
class VLLMConfig:
    """The colocated vLLM engine of ``rollout=vllm`` (grail_exp/rollout/vllm.py); ignored by other engines."""

    gpu_memory_utilization: float = 0.3  # fraction of GPU memory vLLM may take (weights + KV cache); rest is training's
    max_model_len: int | None = None  # prompt + completion tokens per sequence; null = the model's own limit
    enable_prefix_caching: bool = True  # share the KV cache of the G copies of a prompt (reset after each sync)
    # null = CUDA graphs on a GPU (faster decoding), eager on vLLM's CPU build (it has no graphs and would compile the
    # model with inductor instead: minutes of start); true = eager everywhere; false = graphs (compilation on CPU)
    enforce_eager: bool | None = None
    sleep_mode: bool = False  # offload weights / drop KV cache between rollouts (GPU only; an error on CPU)
    dtype: str | None = None  # engine dtype; null = model.dtype (weights are pushed in this dtype)
    # Which vLLM log-prob the engine reads: raw_logprobs = log softmax(z) of the unprocessed logits, which the
    # engine rescales to log softmax(z/T) (see rollout/vllm.py). processed_logprobs = vLLM's own after temperature,
    # penalties AND top-k/top-p renormalisation (not the trainer's quantity when top_k/top_p are on; the GRAIL
    # reference's, rollout=vllm_paper: the old-log-prob forward then also measures the kept mass M_t, logged as
    # sampling/{seq,token}_log_kept_mass and added back in the sampler check).
    logprobs_mode: str = "raw_logprobs"
    seed: int | None = None  # engine seed of rank 0 (rank r: + 1000 r); null = the run's seed
    # false: training rollouts sample from the engine's batched stream (no per-request seeds on the hot path; in
    # process that is the rank's torch generator, seeded per rank and checkpointed); true: each training completion
    # gets its own seed from torch's RNG, as evaluation's always do (reproducible whatever vLLM batches with it, at a
    # per-request generator call per decoding step on GPU). rollout/vllm.py's docstring says why
    seeded_rollouts: bool = False
    # Tokens vLLM schedules per step (prefill chunks); its profile run, which it subtracts from its share before sizing
    # the KV cache, is one forward of this many tokens (memory/shapes.py counts it). vLLM's own default on 70+ GiB GPUs is
    # 16384, whose profile TRL found misleads the colocated engine; 4096 = TRL's and vLLM's CPU default
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 256  # sequences decoded at once at most (and the profile's sampler rows); vLLM's default below 70 GiB
    # MiB of weights per chunk of a weight sync: the full parameters are gathered (when sharded), cast to the engine's
    # dtype and pushed one chunk at a time, so the sync holds at most this much beyond the model (a larger tensor,
    # e.g. the embedding, travels alone). verl and TRL stream layer by layer / bucket by bucket the same way.
    sync_chunk_mb: int = 256
    kwargs: dict = field(default_factory=dict)  # any further vllm.LLM(...) keyword arguments, passed as is


@dataclass
class RolloutConfig:
    """Sampling of training rollouts (G completions per prompt)."""

    engine: str = MISSING  # hf (transformers generate) | vllm
    num_generations: int = 8  # G, group size (GRPO: DeepSeekMath §4.1; paper: 8)
    max_completion_length: int = 64  # max new tokens; also the dr_grpo normaliser (paper: 4096)
    temperature: float = 1.0  # paper: 1.0
    top_p: float = 1.0  # paper: 1.0
    top_k: int = 0  # 0 = off (paper: 50)
    repetition_penalty: float = 1.0
    generation_batch_size: int = 256  # completions per generate() call (memory knob only)
    # The hf engine's draw on CPU (rollout/hf.py): multinomial = generate's random stream (its tokens under a seed) |
    # inverse_cdf = the same distribution from one uniform per row, ~20x cheaper at a 49k vocabulary. Training and
    # evaluation sampling alike.
    draw: str = "multinomial"
    is_correction: ISCorrectionConfig = field(default_factory=ISCorrectionConfig)
    sampler_check: SamplerCheckConfig = field(default_factory=SamplerCheckConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=lambda: DynamicSamplingConfig())  # DAPO
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout=vllm only (conf/rollout/vllm.yaml)


@dataclass
class EvalConfig:
    """Sampling for evaluation, independent of training sampling (GRAIL paper §7.1: n=3, T=0.6, ...)."""

    name: str = MISSING
    n: int = 3  # samples per problem; pass@k is reported for every k <= n
    temperature: float = 0.6  # 0 = greedy (then n must be 1)
    top_p: float = 0.95
    top_k: int = 20
    max_tokens: int = 8192
    batch_size: int = 256  # completions per generate() call
    n_boot: int = 1000  # bootstrap resamples for confidence intervals
    seed: int = 0  # sampling seed of the evaluation (independent of training)


@dataclass
class BenchmarkConfig:
    """What to evaluate on: one or more registered benchmarks."""

    name: str = MISSING
    names: list = field(default_factory=list)  # registry names (see grail_exp/data/benchmarks.py)
    limit: int | None = None  # take the first N problems of each benchmark (smoke tests)
    instruction: str = ""  # appended to each problem except arithmetic's (data.instruction); paper: spec §7.1
    olympiad_gold: str = "first"  # OlympiadBench gold: first = final_answer[0] | str = str(list), paper eval (§11.14)
    # Which answer is graded (grail_exp/grading/extraction.py). last_balanced: the balanced \boxed{} that starts last
    # (default) | paper: the reference evaluation's extract_boxed_inner, empty samples out of the denominator,
    # tokens averaged over extracted samples | math_verify: math-verify's own extraction over the whole completion.
    extraction: str = "last_balanced"


# ---------------------------------------------------------------------------------------------- algorithm
@dataclass
class KLInRewardConfig:
    """KL penalty folded into the reward before the advantages (Ziegler et al. arXiv 1909.08593; verl use_kl_in_reward):
    r_i <- r_i - beta * sum_t KL_t over the completion's loss tokens. Loads the frozen reference model."""

    enabled: bool = False
    coef: float = 0.001  # initial beta (verl kl_ctrl.kl_coef 0.001)
    estimator: str = "k1"  # per-token KL estimator (grail_exp/loss/kl.py; verl kl_penalty "kl" = k1)
    controller: str = "fixed"  # fixed | adaptive (Ziegler et al.: beta *= 1 + clip((KL - target)/target, +-0.2) * n/horizon)
    target: float = 0.1  # adaptive: target per-token KL (verl target_kl 0.1)
    horizon: int = 10000  # adaptive: horizon in sequences (verl 10000)


@dataclass
class LossConfig:
    """The GRPO objective (method spec §2). Defaults = the GRAIL paper's GRPO baseline (spec §2.2) but for
    num_iterations (paper: 4, recipe=paper), which the CPU demo keeps at 1 for speed."""

    # Advantage normalisation. group: (r - mean_g)/std_g (DeepSeekMath); batch: std over the whole batch;
    # none: r - mean_g (Dr. GRPO, arXiv 2503.20783; the paper's `scale_rewards: false`).
    scale_rewards: str = "none"
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon (PPO)
    epsilon_high: float | None = 0.28  # upper clip: ratio <= 1 + epsilon_high (DAPO clip-higher); null = epsilon
    # grpo: per-sequence token mean, then mean (DeepSeekMath) | bnpo: token mean over the micro-batch |
    # dr_grpo: token sum / (B * max_completion_length) (Dr. GRPO) | dapo: token sum / tokens in the global batch (DAPO)
    loss_type: str = "dr_grpo"
    beta: float = 0.0  # KL coefficient; > 0 loads a frozen reference model (DeepSeekMath: 0.04)
    # k1 | k2 | k3 | abs | k1+ | k3+ (straight-through: value of k1/k3, gradient of k2) (Schulman's estimators; k3 = TRL
    # / the GRAIL reference), grail_exp/loss/kl.py
    kl_estimator: str = "k3"
    policy_loss: str = "ppo_clip"  # the per-token objective (grail_exp/loss/policy.py registry)
    terms: dict = field(default_factory=dict)  # auxiliary loss terms: {name: {its config}} (grail_exp/loss/terms.py)
    num_iterations: int = 1  # mu: optimiser steps per rollout batch, with old log-probs (paper: 4)
    mask_truncated_completions: bool = True  # completions without EOS add no loss (DAPO overlong filtering)
    # --- GRPO family (grail_exp/loss/policies/, docs/grpo-family.md). Defaults = off / the papers'.
    clip_ratio_c: float | None = None  # ppo_clip dual-clip c > 1: loss <= -c*A for A < 0 (arXiv 1912.09729; verl: 3.0); dppo_*: ratio cap; null = off
    delta: float | None = None  # ppo_clip two-sided clipping: ratio <= delta in the unclipped branch (INTELLECT-2 arXiv 2505.07291; TRL); null = off
    sapo_tau_pos: float = 1.0  # sapo gate temperature for A > 0 (SAPO arXiv 2511.20347; TRL/verl default 1.0)
    sapo_tau_neg: float = 1.05  # sapo gate temperature for A <= 0 (SAPO; TRL/verl default 1.05)
    vespo_k_pos: float = 2.0  # vespo Gamma shape k for A >= 0 (VESPO arXiv 2602.10693; TRL default 2.0)
    vespo_lambda_pos: float = 3.0  # vespo Gamma rate lambda for A >= 0 (TRL default 3.0)
    vespo_k_neg: float = 3.0  # vespo k for A < 0 (TRL default 3.0)
    vespo_lambda_neg: float = 2.0  # vespo lambda for A < 0 (TRL default 2.0)
    clip_cov_ratio: float = 2e-4  # clip_cov: fraction of tokens whose gradient is detached (arXiv 2505.22617; verl 2e-4)
    clip_cov_lb: float = 1.0  # clip_cov: lower bound of the token covariance eligible for detaching (verl 1.0)
    clip_cov_ub: float = 5.0  # clip_cov: upper bound (verl 5.0)
    kl_cov_ratio: float = 2e-4  # kl_cov: fraction of top-covariance tokens given the |log ratio| penalty (verl 2e-4)
    kl_cov_coef: float = 0.1  # kl_cov: coefficient of that penalty (verl ppo_kl_coef 0.1)
    kl_bias_correction: bool = False  # multiply the KL term by the ratio pi/pi_old (TRL use_bias_correction_kl; DeepSeek-V3.2 arXiv 2512.02556)
    top_entropy_quantile: float = 1.0  # rho: keep only the top-rho highest-entropy tokens in the loss (arXiv 2506.01939; 0.2 there); 1 = off
    kl_in_reward: KLInRewardConfig = field(default_factory=lambda: KLInRewardConfig())  # KL folded into the reward
    # OPSM delta: drop A < 0 sequences with mean KL(sampler||policy) > delta (DeepSeek-V3.2); null = off
    off_policy_mask_threshold: float | None = None
    # The two masks above multiply the policy term only. unmasked (TRL, DeepSeek-V3.2): the normaliser counts every loss
    # token and beta*KL stays on masked tokens | kept: they shrink the loss mask itself, normaliser and KL included
    # (docs/deviations.md)
    family_mask_normaliser: str = "unmasked"
    # Tokens whose entropies give the top_entropy_quantile threshold: all (the micro-batch's loss tokens, before the
    # off-policy mask: TRL) | off_policy_kept (only the rows OPSM keeps)
    top_entropy_population: str = "all"
    # gmpo with rollout IS weights: geometric (their per-sequence geometric mean, verl geo_mean) | arithmetic (their
    # arithmetic mean over the sequence's tokens)
    gmpo_is_mean: str = "geometric"


@dataclass
class OptimConfig:
    """AdamW (transformers' TrainingArguments defaults, as the paper) with a constant-with-warmup schedule."""

    lr: float = 1e-4  # the embedded 0.4 M-parameter model's (3e-4 collapsed it); the paper: 1e-6 on 4-8B models (recipe=paper)
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warmup from 0 (transformers' constant_with_warmup: step 0 has lr 0), in schedule_unit
    # What one step of the lr schedule is: optimizer_step (TRL / transformers: the scheduler steps after every optimiser
    # step) | rollout_batch (verl, EasyR1: actor_lr_scheduler.step() once per update_actor, i.e. once per rollout
    # batch after its k x mu optimiser steps, which all share one rate). Recipes ported from verl set rollout_batch.
    schedule_unit: str = "optimizer_step"
    max_grad_norm: float | None = 1.0  # null = no clipping
    # fp32 master weights + fp32 Adam state for a bf16 model (grail_exp/optim.py); null = on for half-precision
    # models. Without them, Adam steps of ~lr = 1e-6 vanish in bf16 rounding (the paper's DeepSpeed keeps masters).
    master_weights: bool | None = None
    # validate() refuses optim.lr > 1e-5 on a pretrained hub model (the demo's 1e-4 wrecks 4-8B weights within tens
    # of steps; the paper: 1e-6). true = "I mean this learning rate". Default false.
    allow_high_lr: bool = False
    # Gradient accumulation over a step's micro-batches for a bf16 model: fp32 (the fp32 masters collect each
    # backward's gradient) | bf16 (summed in the parameters' bf16 .grad, as DeepSpeed ZeRO's bf16 default, the
    # reference's) | null = the strategy's own (one process: fp32; DDP: bf16 .grad, fp32 all-reduce; FSDP: fp32;
    # ZeRO-2: DeepSpeed's data_types.grad_accum_dtype, default the model's dtype). Explicit values: trainer.strategy=auto.
    grad_accum_dtype: str | None = None


@dataclass
class TrainerConfig:
    """The training loop and hardware (Lightning Trainer)."""

    name: str = MISSING
    accelerator: str = "cpu"
    devices: Any = 1
    strategy: str = "auto"
    precision: str = "32-true"
    # optimiser steps (each rollout batch gives mini_batches_per_rollout x loss.num_iterations); recipes from verl-based
    # codebases state rollout batches: ${optimizer_steps:N,${loss.num_iterations},${trainer.mini_batches_per_rollout}}
    max_steps: int = 200
    prompts_per_step: int = 16  # prompts per rollout batch (x G completions); paper: 32 x 8 = 256
    micro_batch_size: int = 64  # completions per forward/backward; gradient accumulation covers the rest
    # k: optimiser steps per pass over a rollout batch, each on 1/k of its prompts (whole groups, in rollout order),
    # for loss.num_iterations passes: k x mu steps per rollout batch. verl's ppo_mini_batch_size = prompts_per_step / k
    # (its dp_actor splits the batch in order, ppo_epochs = mu); 1 = TRL's layout, the whole batch per step.
    mini_batches_per_rollout: int = 1
    log_every: int = 1  # optimiser steps between metric logs
    # Optimiser steps between one-line INFO progress logs (step, reward, loss, length, s/step, ETA): what a log
    # redirected to a file (SLURM, CI, nohup) shows, where the progress bar does not reach; 0 = off
    progress_log_every: int = 10
    sample_table_every: int = 50  # optimiser steps between logged tables of sample completions (0 = off)
    num_logged_samples: int = 8  # completions per sample table
    eval_every: int = 0  # optimiser steps between in-training evaluations (0 = only at the end)
    eval_before_training: bool = True  # evaluate the starting model too (gives the "before" column)
    eval_at_end: bool = True
    log_entropy: bool = True  # token entropy of the policy (costs a (B, T, V) softmax)
    checkpoint_every: int = 0  # optimiser steps between checkpoints (0 = only the final one)
    keep_last_checkpoints: int | None = 3  # prune older complete checkpoints; null = keep all
    save_final_checkpoint: bool = True
    # trainer=fsdp: which checkpoints carry the full Hugging Face weights in model.dtype (streamed to rank 0 one
    # gathered tensor at a time), beside the shards resume reads: final (the run's last checkpoint only: what
    # evaluation, vLLM and the study read) | every. Other strategies always write them: there they are the model part
    export_hf_weights: str = "final"
    # Optimiser steps between weights-only trajectory saves <run dir>/trajectory/step-<N>/ (HF dir, no optimiser
    # state, never pruned), plus step-0 (the starting weights) and the last step; 0 = off. The input of
    # `python -m grail_exp.extrapolate` (RELEX, arXiv 2605.21468, fits every-step checkpoints: 1)
    save_weights_only_every: int = 0
    max_nonfinite_in_a_row: int = 3  # skipped non-finite steps tolerated in a row before aborting
    num_threads: int | None = None  # torch CPU threads; null = torch default
    deterministic: bool = False
    num_nodes: int = 1  # data-parallel nodes (world size = devices x num_nodes)
    process_group_backend: str | None = None  # null = nccl on GPU, gloo on CPU
    # Seconds a rank waits in a collective before the process group aborts the run (every group the run creates);
    # null = what the planned checkpoint write needs: max(1800, 2 x its bytes / 100 MB/s) (memory.needed_dist_timeout)
    dist_timeout_s: int | None = None
    # Seconds the ranks that arrived wait for the others when the process group forms (a node that never started, a
    # wrong trainer.num_nodes / trainer.devices or master address); then one line names who arrived. It must cover the
    # ranks' different start-ups: rank 0 reads the weights while the others build empty skeletons (docs/reliability.md)
    rendezvous_timeout_s: int = 600
    sharding_strategy: str | None = None  # trainer=fsdp: FULL_SHARD (ZeRO-3-like, default) | SHARD_GRAD_OP (ZeRO-2-like)
    # trainer=deepspeed_zero2: keys merged into DeepSpeed's config (grail_exp/training/backends/deepspeed.py), e.g. zero_optimization
    deepspeed: Any | None = None
    # Rows of (rows, V) logits alive at once in the policy's log-prob / entropy pass (grail_exp/compute/logprobs.py):
    # bounds the memory of the 151,936-token vocabulary; one chunk covering the micro-batch = no recompute.
    logprob_chunk_tokens: int = 4096
    # GiB of one device for the memory plan (grail_exp/memory/) when planning offline; null = torch.cuda.mem_get_info
    # of this rank's device (no CUDA device: no verdict; CPU runs are never refused). docs/memory-planner.md
    device_memory_gb: float | None = None
    # Precision of the policy's token log-probs (grail_exp/compute/logprobs.py): float32 = the softmax in float32 (default);
    # model = logits / T and log_softmax in the model's dtype, as the GRAIL reference (TRL) rounds them (bf16: most
    # ratios are exactly 1 after a small update). The ratio arithmetic, entropies and the backward stay float32.
    logprob_dtype: str = "float32"
    # Each distinct prompt of a micro-batch computed once in every forward of the update (policy, old / reference
    # log-probs, probes, teachers): the G completions of a prompt reuse its keys and values, and its gradient is
    # accumulated once (grail_exp/compute/forward.py). Same numbers up to floating-point reduction order. auto = on unless
    # model.gradient_checkpointing (a replayed layer has no cache); true | false. docs/performance.md
    share_prompts: Any = "auto"
    # The tokens every distinct prompt of a micro-batch starts with (system prompt, few-shot turns) computed once too,
    # in the update's forwards and in the HF engine's prefill: one pass over them, then each prompt's tail attends to
    # their keys and values (grail_exp/compute/forward.py: prompts_once). Same numbers up to reduction order. auto = when it
    # saves >= 64 positions ((distinct prompts - 1) x prefix length); true = whenever there is one; false.
    share_prompt_prefix: Any = "auto"
    # CPU runs: points in each backward where freed heap goes back to the OS (glibc malloc_trim; grail_exp/compute/host.py),
    # evenly spaced down the decoder layers, the last after the first layer, before the embedding's gradient. The heap
    # the backward frees is otherwise kept and its high-water mark, not the live tensors, makes the peak RSS. 1 costs
    # nothing measurable; each further point re-faults what it returned (docs/performance.md). 0 = none. GPU runs: no
    # effect.
    backward_heap_returns: int = 1
    # A backward whose cotangent lives on a micro-batch's leading rows (GRAIL's probe: the trainer puts its rows first)
    # computes those rows only: the policy's linear layers become RowNarrowingLinear (same parameters, same forward,
    # the same gradients outside such a backward) and the CPU attention narrows too (grail_exp/compute/leading_rows.py). Same
    # numbers up to the products' rounding. null = on for CPU runs, off on CUDA until a GPU measures it; true | false.
    narrow_backward: bool | None = None
    weights_table_every: int = 50  # optimiser steps between tables of per-token weights (report plots); 0 = off
    weights_table_rows: int = 32  # completions per weights table
    # Evaluations through the completion cache (grail_exp/evaluate.py): the one before training is keyed by the
    # starting weights' sha256, so every run that starts from the same weights with the same evaluation settings
    # samples it once (a study's arms: one "before" for all); later ones are keyed by this run and step, so an
    # evaluation cut off by a kill continues where it stopped after resume=auto.
    eval_cache: bool = False


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment (arXiv 2503.14476 §3.4): r += min(0, -(L - (L_max - buffer)) / buffer) * factor."""

    enabled: bool = False
    length: int = 16  # buffer L_cache in tokens before rollout.max_completion_length (DAPO: 4096 of 20480)
    penalty_factor: float = 1.0  # penalty at L = L_max (DAPO: 1.0)


@dataclass
class RewardConfig:
    """Grading: last \\boxed{} -> math-verify in killable worker processes (method spec §2.2)."""

    num_workers: int = 2  # grading processes; 0 = grade in the main process (no hard timeout)
    hard_timeout_s: float = 15.0  # wall-clock limit per answer; the worker is killed past it (counted)
    parse_timeout: int = 5  # math-verify's own parse timeout (seconds), as in the reference
    verify_timeout: int = 5  # math-verify's own verify timeout (seconds)
    # Which answer the reward grades (grail_exp/grading/extraction.py). last_balanced: the balanced \boxed{} that starts
    # last (default) | paper: the reference reward's regex (last non-nested box, stripped) | math_verify:
    # math-verify's own extraction over the whole completion (TRL accuracy_reward's settings).
    extraction: str = "last_balanced"
    overlong_buffer: OverlongBufferConfig = field(default_factory=lambda: OverlongBufferConfig())  # DAPO soft overlong punishment


@dataclass
class LoggerConfig:
    """Experiment tracking. MLflow by default (sqlite under results/; MLFLOW_TRACKING_URI wins)."""

    name: str = MISSING  # mlflow | none
    tracking_uri: str | None = None  # null -> env MLFLOW_TRACKING_URI, else sqlite:///<results>/mlflow.db
    experiment_name: str = "grail_exp"
    run_name: str | None = None  # null -> <model>-<advantage>-seed<seed>
    artifact_location: str | None = None  # null -> <results>/mlartifacts
    tags: dict = field(default_factory=dict)
    # MLflow parent run to nest this run under (mlflow.parentRunId); null = the multirun's parent, if any
    # (grail_exp/sweep.py). Optuna trials set it to their study's parent run.
    parent_run_id: str | None = None


@dataclass
class PathsConfig:
    """Where everything goes, the same for every entry point; GRAIL_EXP_ROOT / GRAIL_EXP_CACHE move the tree."""

    root_dir: str = "${oc.env:GRAIL_EXP_ROOT,.}"
    results_dir: str = "${paths.root_dir}/results"  # mlflow.db, mlartifacts/, tables worth keeping
    cache_dir: str = "${oc.env:GRAIL_EXP_CACHE,${oc.env:HOME,.}/.cache/grail_exp}"  # warm-started embedded models, evals/ (evaluate's resume cache)
    log_dir: str = "${paths.root_dir}/outputs"  # Hydra run directories
    output_dir: str = "${hydra:runtime.output_dir}"  # this run's directory


@dataclass
class StudyConfig:
    """A study on disk (grail_exp/analysis/study.py): each finished arm's evaluation summary goes to ``<dir>/<arm>/``, and a
    job whose arm is already there (same configuration) is skipped, so a restarted study continues."""

    dir: str | None = None  # null = not part of a study; e.g. results/real_model_study/<study>
    arm: str | None = None  # the arm's folder; null = <model>-<scheme>-s<seed>


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (``peft=lora``): LoRA adapters on a frozen base (grail_exp/models/lora.py,
    docs/lora.md). ``name: none`` trains every parameter (the paper's full fine-tuning); the other keys then do nothing.
    Defaults: "LoRA without regret" (Schulman et al., Thinking Machines 2025; TRL's docs page of that name): in RL even
    rank 1 matches full fine-tuning, on every linear layer, at ~10x the full fine-tuning learning rate (a recipe's lr)."""

    name: str = "none"  # none (full fine-tuning) | lora
    rank: int = 32  # r, the adapter's inner dimension (small ranks suffice for RL; 32 costs Qwen3-8B 87 M parameters)
    alpha: float = 32.0  # lora_alpha: B A is scaled by alpha / rank (alpha fixed across ranks keeps the best lr put)
    dropout: float = 0.0  # on the adapter's input while training; > 0 makes old / new log-prob ratios noisy
    # every linear layer of attention and MLP (the embeddings and the output layer stay frozen: the probes' leaf)
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"])
    # How the engine follows the policy: adapter (vLLM: the adapter each sync under a new name, the base pushed once;
    # HF: samples the live adapters) | merged (W + alpha/r BA computed in fp32 from the unchanged base, pushed in
    # chunks; HF: a merged copy of the adapted layers swapped in to generate, as fast as full fine-tuning's decoding)
    sync: str = "adapter"
    # null: the adapters are held and computed in model.dtype with fp32 master weights in the optimiser, as full
    # fine-tuning trains its weights (FSDP: its fp32 shards) | float32: PEFT's default, fp32 adapters and branch (a cast
    # copy of each layer's input: slower on the CPU, docs/lora.md)
    adapter_dtype: str | None = None
    # Checkpoints hold the adapter (a PEFT adapter folder); true: the final checkpoint also holds the merged model as
    # a Hugging Face folder, <checkpoint>/merged/ (what evaluate / vLLM read without PEFT)
    export_merged: bool = False


@dataclass
class RunConfig:
    """Root schema: the config groups plus run-level keys."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)  # which recipe composed the run (conf/recipe/)
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    rollout: RolloutConfig = MISSING
    eval: EvalConfig = MISSING
    benchmark: BenchmarkConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    advantage: Any = MISSING  # typed per scheme by the registry (grail_exp/advantages)
    estimator: Any = MISSING  # typed per estimator by the registry (grail_exp/estimators)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)  # full fine-tuning or LoRA adapters (conf/peft/)
    task_name: str = "train"  # names the run directory and the MLflow run (experiment files set their own)
    # null = a fresh start | auto: continue the latest complete checkpoint of this run directory (pass the same
    # hydra.run.dir) | a checkpoints/step-N directory
    resume: str | None = None
    seed: int = 42  # the run seed: sampling, data order, OAR-G's noise (the paper's 42)
    optimized_metric: str | None = "eval/arithmetic/acc"  # the value run() returns (sweeps, Optuna)
    experiment: Any = None  # free-form notes set by experiment files
    tune: Any = None  # Optuna study settings of `python -m grail_exp.tune` (conf/tune.yaml; typed in grail_exp/tune.py)
    study: StudyConfig = field(default_factory=StudyConfig)
    extras: dict = field(default_factory=dict)


@dataclass
class WeightsConfig:
    """Schema of ``python -m grail_exp.weights`` (conf/weights.yaml)."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    advantage: Any = MISSING
    paths: PathsConfig = field(default_factory=PathsConfig)
    input: str = MISSING  # JSONL file of rollouts (required)
    output: str = MISSING  # JSON file to write: one object per input row, in order (required)
    html: str | None = None  # optional heatmap of the weights
    device: str = "cpu"
    dtype: str = "float32"  # computation dtype (overrides model.dtype)
    sampling_temperature: float = 1.0  # what GRAIL's probe divides by when advantage.saliency_temperature is null
    seed: int = 0  # seeds OAR-G's noise
    batch_size: int = 64  # rows per scheme call (weights do not depend on the batching)


@dataclass
class EvaluateConfig:
    """Schema of ``python -m grail_exp.evaluate`` (conf/evaluate.yaml)."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING  # builds the embedded model; the arithmetic benchmark uses its knobs
    benchmark: BenchmarkConfig = MISSING
    eval: EvalConfig = MISSING
    rollout: RolloutConfig = MISSING  # only `engine` is used: evaluation sampling comes from `eval`
    logger: LoggerConfig = MISSING
    reward: RewardConfig = field(default_factory=RewardConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    task_name: str = "evaluate"
    seed: int = 0
    device: str | None = None  # e.g. cuda; null = where the model loads (CPU)
    optimized_metric: str | None = "eval/avg/acc"  # with one benchmark: eval/<benchmark>/acc


@dataclass
class PreflightConfig:
    """``preflight.*`` keys of ``python -m grail_exp.preflight <the run's overrides> [preflight.<key>=<value>]``
    (grail_exp/preflight/): the dress rehearsal of a run, shrunk in depth, in its real layout."""

    layers: int | None = 2  # decoder layers of the rehearsal (random weights, real widths and vocabulary); null = the model as configured
    rounds: int = 2  # rollout batches of the training run (x loss.num_iterations x trainer.mini_batches_per_rollout steps)
    stop_rank: int = 1  # the rank the stop signal (SIGTERM) is sent to, during the resumed run's first step (clamped to the world)
    stop_timeout_s: float = 600.0  # bound from the signal to the job's end; past it the job is killed and the check fails
    run_timeout_s: float = 7200.0  # bound on each rehearsal run (a hang before the signal)
    # problems per benchmark in the final evaluation; null = the fewest (at least 4) that give every rank a chunk of
    # eval.batch_size / eval.n problems
    eval_limit: int | None = None
    logprob_tolerance: float | None = None  # engine vs trainer: |d| <= tol x (1 + |log p|); null = 1e-3 in float32, 2^-6 in 16-bit
    dir: str | None = None  # the rehearsal's runs, probes and logs; null = ./preflight-<date>-<time>


def rollout_batches(max_steps, num_iterations, mini_batches) -> int:
    """``${rollout_batches:max_steps,mu,k}``: rollout batches a run of ``max_steps`` optimiser steps draws (each gives
    k mini-batches x mu epochs of steps); schedules that count rollout batches (SDPG's T) use it."""
    per = int(num_iterations) * int(mini_batches)
    return -(-int(max_steps) // per)


def optimizer_steps(rollout_batches, num_iterations, mini_batches) -> int:
    """``${optimizer_steps:N,mu,k}``: the optimiser steps of N rollout batches (N x k mini-batches x mu epochs). The
    recipes ported from verl-based codebases state their length this way in verl's unit, trainer steps = rollout
    batches (``trainer.total_training_steps``), so ``trainer.max_steps`` follows a change of k or mu."""
    return int(rollout_batches) * int(num_iterations) * int(mini_batches)


def floordiv(a, b) -> int:
    """``${floordiv:a,b}``: a // b, for a value that follows another (DAPO's overlong buffer: a quarter of
    rollout.max_completion_length, conf/algo/dapo.yaml)."""
    return int(a) // int(b)


def slurm_tasks(devices) -> int:
    """``${slurm_tasks:${trainer.devices}}``: SLURM tasks per node = ranks per node (Lightning under SLURM runs one
    task per device and refuses any other count when the job starts)."""
    from grail_exp.world import devices_per_node

    return devices_per_node(devices)


def slurm_gpus(accelerator, devices) -> int | None:
    """``${slurm_gpus:${trainer.accelerator},${trainer.devices}}``: GPUs per node = ranks per node; none for CPU runs."""
    return None if str(accelerator) == "cpu" else slurm_tasks(devices)


def register_configs() -> None:
    for name, fn in (("rollout_batches", rollout_batches), ("optimizer_steps", optimizer_steps),
                     ("floordiv", floordiv), ("slurm_tasks", slurm_tasks), ("slurm_gpus", slurm_gpus)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(name="weights_schema", node=WeightsConfig)
    cs.store(name="evaluate_schema", node=EvaluateConfig)
    store_method_schemas(cs)


def store_method_schemas(cs: ConfigStore) -> None:
    """Each registered method's dataclass defaults as ``schema/<group>/<name>``: the first layer of its group file
    (conf/advantage/grail.yaml: ``- /schema/advantage@_here_: grail``), so a method's values are stated once, in the
    dataclass beside its code, and still composed (``--cfg job``). Untyped: validate() types the node, as before."""
    from grail_exp.advantages import SCHEMES
    from grail_exp.estimators import ESTIMATORS
    from grail_exp.loss import LOSS_TERMS

    for group, registry in (("advantage", SCHEMES), ("estimator", ESTIMATORS), ("loss_term", LOSS_TERMS)):
        for name, method in registry.items():
            node = OmegaConf.to_container(OmegaConf.structured(method.config_class))
            if group != "loss_term":  # an estimator without its own dataclass shares EstimatorConfig's name
                node["name"] = name
            cs.store(group=f"schema/{group}", name=name, node=node)

