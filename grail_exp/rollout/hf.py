"""``rollout=hf``: sampling on the policy itself with a KV cache, on any device.

Shares the policy's weights, so ``sync_weights`` has nothing to do (``HFMergedLoraEngine``, under ``peft=lora
peft.sync=merged``, keeps its own merged copy of the adapted layers instead). The model's own ``generation_config`` is ignored
on purpose: every sampling knob comes from our config, so a checkpoint's defaults (Qwen3 ships T=0.6, top_k=20)
never leak in.

The decode loop (``sample``) is transformers ``generate``'s sampling, written for this workload:

- **each distinct prompt is prefilled once**: the n completions of a prompt start from copies of its keys and values
  (``generate`` with ``num_return_sequences`` prefills the n copies of each prompt; for 4 prompts x 8 completions of
  ~130 tokens that was 8x the prefill work), and the tokens all the prompts start with (a system prompt, few-shot
  turns) once for all of them (``common_prefix``: ``grail_exp.compute.forward.prompts_once``, ``trainer.share_prompt_prefix``);
- **the cache is preallocated** (prompt + the token budget) and written in place, instead of a concatenation of the
  whole cache at every step;
- **finished completions leave the batch**: rows that emitted a stop token are dropped from the forward (in steps,
  so the cache is compacted a few times, not at every token);
- the log-prob of each sampled token, log softmax(z / T) over the full vocabulary, is read from the step's own
  scores; no logits processor object per call, no (N, V) tensor kept across steps.

Same sampling distribution and the same random stream as ``generate``: the repetition penalty, temperature, top-k and
top-p are transformers' own processors in ``generate``'s order, and the draw is ``torch.multinomial``'s
(``argmax(p / q)`` with q ~ Exp(1) drawn for *every* row of the batch, finished ones included, as ``multinomial`` on
the whole batch does). With bit-equal logits the tokens are those ``generate`` samples under the same seed
(tests/test_rollout.py checks it); sharing the prefill changes the logits' last bits only (a smaller matrix product),
so a draw that falls within rounding of a category boundary can differ — equally likely either way.
The draw over a large vocabulary is the costly part of a decode step on CPU: ``multinomial``'s B x V exponential
variates and top-p's sort of the whole vocabulary each cost more than the step's matrix products at 135 M parameters
(docs/performance.md). ``draw="inverse_cdf"`` samples the same distribution from one uniform per row (the cumulative
distribution searched), with top-p evaluated on the top-k candidates only when top-k is on: other tokens than
``generate`` under the same seed, drawn much faster.
``decode="transformers"`` keeps ``generate`` itself (models whose layers do not all attend to every earlier
position, e.g. sliding windows, use it automatically).
"""

from __future__ import annotations

import contextlib

import torch

from grail_exp.compute.attention import SDPA_GQA, RowGroups
from grail_exp.compute.forward import (
    can_share_prompts,
    decoder_body,
    output_layer,
    position_ids_from_mask,
    prompts_once,
)
from grail_exp.compute.model_attention import DECODE_PROMPTS, decode_cache, register_decode_attention
from grail_exp.rollout.base import Completion, SamplingParams

DECODERS = ("lean", "transformers")
DRAWS = ("multinomial", "inverse_cdf")  # the lean decoder's draw (module docstring)


class SampledTokenLogprobs:
    """A logits processor recording log softmax(z / T)[sampled token] per step, never more than one (N, V) step
    (``decode="transformers"``).

    transformers runs custom processors after its own (repetition penalty, ...) and *before* the sampling
    warpers (temperature, top-k, top-p), so ``scores`` here are the untruncated logits. The token drawn from
    them is only known at the next call (the last column of ``input_ids``); the last step is picked by
    ``finish`` from the returned sequences.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature if temperature > 0 else 1.0  # greedy: the model's own distribution
        self.pending: torch.Tensor | None = None  # (N, V) log-probs of the step whose token is not known yet
        self.picked: list[torch.Tensor] = []  # (N,) per generated step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.picked.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(N, C) log-probs of the generated tokens, given the last generated column."""
        if self.pending is not None:
            self.picked.append(self.pending.gather(1, last_tokens.unsqueeze(1).to(self.pending.device)).squeeze(1))
            self.pending = None
        return torch.stack(self.picked, dim=1)


class HFRolloutEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256, stop_token_ids: list[int] | None = None,
                 decode: str = "lean", draw: str = "multinomial", common_prefix="auto"):
        if decode not in DECODERS:
            raise ValueError(f"decode must be one of {DECODERS}, got {decode!r}")
        if draw not in DRAWS:
            raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
        self.draw = draw
        self.common_prefix = common_prefix  # the lean decoder's prefill (``prompts_once``): auto | true | false
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # completions per call (the memory knob)
        self.decode = decode
        stops = stop_token_ids or [tokenizer.eos_token_id]
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in stops:
            stops = [*stops, tokenizer.pad_token_id]  # a completion that emits the pad token has ended too
        self.stop_token_ids = stops

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # same object: generation always sees the live weights

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        per_call = max(1, self.batch_size // params.n)
        lean = self.decode == "lean" and lean_decoding_applies(self.model)
        out: list[Completion] = []
        try:
            for start in range(0, len(prompts), per_call):
                chunk = prompts[start:start + per_call]
                ids, attn = left_pad(chunk, self.tokenizer.pad_token_id, device)
                if lean:
                    seqs, logprobs = sample(self.model, ids, attn, params, self.stop_token_ids,
                                            self.tokenizer.pad_token_id, draw=self.draw,
                                            common_prefix=self.common_prefix)
                else:
                    seqs, logprobs = self._transformers_generate(ids, attn, params)
                out.extend(self._completions(chunk, seqs.cpu(), logprobs, params))
        finally:
            self.model.train(was_training)
        return out

    def _transformers_generate(self, ids, attn, params: SamplingParams):
        from transformers import GenerationConfig, LogitsProcessorList

        greedy = params.temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p, top_k=None if greedy else params.top_k,
            repetition_penalty=params.repetition_penalty, max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n, eos_token_id=self.stop_token_ids, pad_token_id=self.tokenizer.pad_token_id,
            return_dict_in_generate=True)
        recorder = SampledTokenLogprobs(params.temperature) if params.logprobs else None
        # synced_gpus=False: the trainer generates with every parameter present on this rank (the update backend's
        # ``generation`` context), so no rank needs the others to keep stepping. transformers' default for an FSDP
        # model all-reduces "finished?" at every token, which hangs when ranks make different numbers of calls
        # (their shares of an evaluation).
        res = self.model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg,
                                  logits_processor=LogitsProcessorList([recorder]) if recorder else None,
                                  synced_gpus=False)
        seqs = res.sequences[:, ids.shape[1]:]  # (len(chunk)*n, C)
        logprobs = recorder.finish(seqs[:, -1]).cpu() if recorder and seqs.shape[1] else None
        return seqs, logprobs

    def _completions(self, chunk, seqs: torch.Tensor, logprobs, params: SamplingParams) -> list[Completion]:
        stops = torch.tensor(self.stop_token_ids)
        completions = []
        for r in range(seqs.shape[0]):
            row = seqs[r]
            is_stop = torch.isin(row, stops)
            if is_stop.any():
                length, truncated = int(is_stop.nonzero()[0]) + 1, False
            else:
                length, truncated = row.shape[0], True
                if length < params.max_new_tokens:  # cannot happen with generate; guard the invariant
                    truncated = False
            completions.append(Completion(
                prompt_ids=chunk[r // params.n], token_ids=row[:length].tolist(),
                logprobs=logprobs[r, :length].tolist() if logprobs is not None else None, truncated=truncated))
        return completions


class HFMergedLoraEngine(HFRolloutEngine):
    """``rollout=hf`` under ``peft=lora peft.sync=merged``: sampling from the merged weights W + (α/r)·B A, so a decoded
    token costs what it costs under full fine-tuning (no adapter products and no adapter wrapper per layer: at the few
    rows of a decode step they made the CPU's generation ~1.4x slower, results/lora.md).

    The engine holds its own copy of the adapted layers' merged weights only (embeddings, norms and the output layer
    are the policy's own, shared). The trainer streams W + (α/r)·B A at each sync, computed in fp32 from the unchanged
    base (``training/backends/base.py``'s ``sync_lora``, the stream vLLM's merged mode gets) and cast to the base's
    dtype; to generate, each adapted layer of the policy is replaced by its base layer (no adapter wrapper on the
    path) with its storage swapped for the merged copy, all restored after. The trainer's own weights are never
    written (no merge / unmerge drift: TRL #6688), and the engine samples the policy of its last sync, as an engine
    with its own weights does. Every rank holds the whole policy (one process, DDP, DeepSpeed ZeRO-2); validate.py
    refuses it where the strategy's backend shards the parameters (FSDP)."""

    sync_chunk_bytes = 256 << 20  # how the trainer batches the stream (all of it stays in this process)

    def __init__(self, model: torch.nn.Module, tokenizer, **kwargs):
        from grail_exp.models import lora

        super().__init__(model, tokenizer, **kwargs)
        self.targets = {lora.base_state_name(n): p for n, p in model.named_parameters() if ".base_layer.weight" in n}
        if not self.targets:
            raise ValueError(f"{type(model).__name__} has no LoRA layers to merge (HFMergedLoraEngine needs peft=lora)")
        # (parent, attribute, the adapted layer) of every module that wraps a base layer: replaced while generating
        modules = dict(model.named_modules())
        self.wrappers = [(modules[n.rpartition(".")[0]], n.rpartition(".")[2], m) for n, m in modules.items()
                         if isinstance(getattr(m, "base_layer", None), torch.nn.Linear) and "." in n]
        self.dtype = next(iter(self.targets.values())).dtype  # the frozen base's: what the merged copy is held in
        self.merged: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def load_weights(self, chunks) -> None:
        """Take the merged layers of a stream of ``(Hugging Face name, tensor)`` chunks (the whole model's: the other
        tensors are the policy's own and are skipped)."""
        got = set()
        for chunk in chunks:
            for name, t in chunk:
                if name not in self.targets:
                    continue
                held = self.merged.get(name)
                if held is None:
                    self.merged[name] = t.to(self.dtype, copy=True)
                else:
                    held.copy_(t)
                got.add(name)
        missing = set(self.targets) - got
        if missing:
            raise RuntimeError(f"the merged weights streamed to the HF engine lack {len(missing)} adapted layers, "
                               f"e.g. {sorted(missing)[0]}")

    def sync_weights(self, model: torch.nn.Module) -> None:
        """The merged weights of an unsharded LoRA policy (``model``, the engine's own), computed here."""
        from grail_exp.models import lora

        pairs = lora.merged_tensors(model.state_dict().items(), lora.policy_scaling(model))
        self.load_weights([[(n, t) for n, t in pairs if n in self.targets]])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not self.merged:
            raise RuntimeError("the HF engine under peft.sync=merged has no merged weights yet: sync it first "
                               "(the trainer's sync_engine, or sync_weights(policy))")
        with self._merged_in():  # no adapter wrapper on the path: nothing to switch off
            return super().generate(prompts, params)

    @contextlib.contextmanager
    def _merged_in(self):
        """Inside the block every adapted layer is its bare base layer holding the merged copy (the storage swapped,
        never written; PEFT's wrapper, even with its adapters off, costs a call and its checks per layer and token)."""
        kept = {name: p.data for name, p in self.targets.items()}
        try:
            for parent, attr, wrapper in self.wrappers:
                setattr(parent, attr, wrapper.base_layer)
            for name, p in self.targets.items():
                p.data = self.merged[name]
            yield
        finally:
            for name, p in self.targets.items():
                p.data = kept[name]
            for parent, attr, wrapper in self.wrappers:
                setattr(parent, attr, wrapper)


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of the prompts left-padded to the longest: (U, P) each."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p):] = 1
    return ids.to(device), attn.to(device)


def _processors(params: SamplingParams):
    """transformers' processors ``generate`` applies, in its order: (before the recorder, sampling warpers)."""
    from transformers import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    before = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty)] if params.repetition_penalty != 1.0 else []
    warpers = []
    if params.temperature > 0:
        if params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            warpers.append(TopKLogitsWarper(top_k=params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=params.top_p))
    return before, warpers


def lean_decoding_applies(model) -> bool:
    """Whether ``sample`` runs for this model: on CPU (where the per-token overhead of ``generate`` is the cost; on GPU
    its kernels are what a long generation needs), every layer attending to all earlier positions
    (``forward.can_share_prompts``), an attention that accumulates in float32 like the grouped decode attention (SDPA
    kernels; eager attention in a float32 model)."""
    impl = getattr(model.config, "_attn_implementation", None)
    p = next(model.parameters())
    return (p.device.type == "cpu" and can_share_prompts(model)
            and (impl in ("sdpa", SDPA_GQA) or (impl == "eager" and p.dtype in (torch.float32, torch.float64))))


@torch.no_grad()
def sample(model, ids: torch.Tensor, attn: torch.Tensor, params: SamplingParams, stop_ids: list[int], pad_id: int,
           compact_at: float = 0.25, draw: str = "multinomial",
           common_prefix="auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``params.n`` completions of each left-padded prompt (U, P): (U·n, T) token ids (``pad_id`` after a row's stop
    token) and their log softmax(z / T) (U·n, T) float32 when ``params.logprobs``; prompt-major rows.

    ``compact_at``: the finished share of the computed rows at which they are dropped from the batch. ``draw``:
    ``multinomial`` (``generate``'s random stream) or ``inverse_cdf`` (the same distribution, faster).
    ``common_prefix``: whether the tokens every prompt starts with are prefilled once (``forward.prompts_once``)."""
    U, P = ids.shape
    n, T = params.n, params.max_new_tokens
    B, dev = U * n, ids.device
    body, (weight, bias) = decoder_body(model), output_layer(model)
    before, warpers = _processors(params)
    pos = position_ids_from_mask(attn)
    pre = prompts_once(model, ids, attn, pos, common_prefix)  # each prompt once (their common prefix once)
    expand = torch.arange(U, device=dev).repeat_interleave(n)  # prompt-major, as generate's num_return_sequences
    groups = RowGroups(expand, U)
    cache = decode_cache(pre.keys_values, pre.mask, T, groups)
    logits = _head(pre.hidden[-1][:, -1], weight, bias).index_select(0, expand)  # (B, V) float32
    del pre  # the prefill's own cache: the decode cache holds the prompts' keys and values (in float32)
    history = torch.cat([ids.index_select(0, expand), ids.new_full((B, T), pad_id)], 1)  # the repetition penalty's
    next_pos = pos[:, -1].index_select(0, expand) + 1
    tokens = ids.new_full((B, T), pad_id)
    logps = torch.zeros(B, T, dtype=torch.float32, device=dev) if params.logprobs else None
    stops = torch.tensor(stop_ids, device=dev)
    rows = torch.arange(B, device=dev)  # the rows still computed (cache row i = completion rows[i])
    live = torch.ones(B, dtype=torch.bool, device=dev)  # unfinished, per computed row
    impl = model.config._attn_implementation
    try:
        model.config._attn_implementation = register_decode_attention()
        for t in range(T):
            scores = logits
            for proc in before:
                scores = proc(history[rows, :P + t], scores)
            nxt = (_draw(scores, warpers, params, B, rows) if draw == "multinomial"
                   else draw_inverse_cdf(scores, params, B, rows))
            if logps is not None:
                logps[rows, t] = torch.log_softmax(scores / (params.temperature or 1.0), -1).gather(
                    1, nxt[:, None]).squeeze(1)
            nxt = torch.where(live, nxt, pad_id)
            tokens[rows, t], history[rows, P + t] = nxt, nxt
            live &= ~torch.isin(nxt, stops)
            if t == T - 1 or not live.any():
                break
            if (~live).float().mean() >= compact_at:  # drop finished rows from the batch and the cache
                keep = live.nonzero().squeeze(1)
                rows, live, next_pos, nxt = rows[keep], live[keep], next_pos[keep], nxt[keep]
                groups = RowGroups(expand[rows], U)
                for layer in cache.layers:
                    layer.kv.keep(keep)
                    layer.kv.groups = groups
            out = body(input_ids=nxt[:, None], position_ids=next_pos[:, None], past_key_values=cache, use_cache=True,
                       **{DECODE_PROMPTS: [layer.kv for layer in cache.layers]})
            next_pos = next_pos + 1
            logits = _head(out.last_hidden_state[:, -1], weight, bias)
    finally:
        model.config._attn_implementation = impl
    return tokens, logps  # log-probs past a row's stop token are 0 or the pad token's: callers cut at the stop


def _head(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Logits of the last position in the model's dtype, then a float32 copy (as ``generate`` reads them)."""
    z = torch.nn.functional.linear(h, weight, bias)
    return z.float()


def _draw(scores: torch.Tensor, warpers: list, params: SamplingParams, B: int, rows: torch.Tensor) -> torch.Tensor:
    """The next token of each computed row: argmax when greedy; else ``torch.multinomial``'s draw, argmax(p / q) with
    q ~ Exp(1) drawn for all B rows (the random stream ``multinomial`` on the whole batch consumes)."""
    if params.temperature == 0:
        return scores.argmax(-1)
    for warp in warpers:
        scores = warp(None, scores)
    probs = torch.softmax(scores, -1)
    q = torch.empty(B, probs.shape[-1], dtype=probs.dtype, device=probs.device).exponential_(1)
    return (probs / q.index_select(0, rows)).argmax(-1)


def draw_inverse_cdf(scores: torch.Tensor, params: SamplingParams, B: int, rows: torch.Tensor) -> torch.Tensor:
    """The next token of each computed row from the distribution transformers' temperature, top-k and top-p warpers
    define (``inverse_cdf_candidates``), sampled by inversion: one uniform u per row of all B (so a row's stream does
    not depend on which rows are still computed), the token whose cumulative probability interval holds u."""
    if params.temperature == 0:
        return scores.argmax(-1)
    u = torch.rand(B, dtype=torch.float64, device=scores.device).index_select(0, rows)
    z, index = inverse_cdf_candidates(scores, params)
    c = torch.softmax(z.double(), -1).cumsum(-1)
    pick = torch.searchsorted(c, (u * c[:, -1]).unsqueeze(1), right=True).squeeze(1)
    pick = torch.minimum(pick, (c < c[:, -1:]).sum(-1))  # rounding at the top: the last token with mass
    return pick if index is None else index.gather(1, pick.unsqueeze(1)).squeeze(1)


def inverse_cdf_candidates(scores: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(candidate scores, their token ids or None for the whole vocabulary in order): z / T, then top-k keeping every
    token tied with the k-th score (as transformers), then top-p keeping the smallest set whose mass exceeds top_p (at
    least one token); removed candidates are -inf. With top-k on, top-p runs on the top-k candidates only (a few
    dozen sorted scores); with top-p alone, on the sorted vocabulary."""
    z = scores / params.temperature if params.temperature != 1.0 else scores
    index = None
    if params.top_k and params.top_k < z.shape[-1]:
        kth = z.topk(params.top_k, -1).values[:, -1:]
        ties = int((z >= kth).sum(-1).max())  # every score >= the k-th, ties included
        z, index = z.topk(ties, -1)  # descending
        z = z.masked_fill(z < kth, float("-inf"))
    elif params.top_p < 1.0:
        z, index = z.sort(-1, descending=True)
    if params.top_p < 1.0:  # z is sorted descending here: transformers' rule, written from the top
        p = torch.softmax(z, -1)
        above = p.cumsum(-1) - p  # mass of the strictly higher-ranked tokens
        z = z.masked_fill(above >= params.top_p, float("-inf"))  # its ascending rule: cum <= 1 - top_p removed
    return z, index
