"""``rollout=hf``: sampling with transformers ``generate`` (KV cache) on the policy itself.

Shares the policy's weights, so ``sync_weights`` has nothing to do. The model's own ``generation_config``
is ignored on purpose: every sampling knob comes from our config, so a checkpoint's defaults (Qwen3 ships
T=0.6, top_k=20) never leak in.

Memory: ``generate`` is never asked for ``output_scores`` (one float32 (N, V) tensor per generated token:
~640 GB for 256 completions × 4,096 tokens at Qwen3's 151,936-token vocabulary). When log-probs are asked
for (``SamplingParams.logprobs``), a logits processor keeps one step's (N, V) log-softmax alive, picks the
sampled token's entry at the next step and drops the rest: O(N·V + N·C) memory instead of O(N·V·C).
"""

from __future__ import annotations

import torch

from grail_exp.rollout.base import Completion, SamplingParams


class SampledTokenLogprobs:
    """A logits processor recording log softmax(z / T)[sampled token] per step, never more than one (N, V) step.

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
    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256, stop_token_ids: list[int] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # completions per generate() call (the memory knob)
        stops = stop_token_ids or [tokenizer.eos_token_id]
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in stops:
            stops = [*stops, tokenizer.pad_token_id]  # a completion that emits the pad token has ended too
        self.stop_token_ids = stops

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # same object: generation always sees the live weights

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from transformers import GenerationConfig

        greedy = params.temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else params.top_k,
            repetition_penalty=params.repetition_penalty,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            return_dict_in_generate=True,
        )
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        per_call = max(1, self.batch_size // params.n)
        out: list[Completion] = []
        try:
            for start in range(0, len(prompts), per_call):
                chunk = prompts[start:start + per_call]
                out.extend(self._generate_chunk(chunk, params, gen_cfg, device))
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, chunk, params, gen_cfg, device) -> list[Completion]:
        from transformers import LogitsProcessorList

        pad = self.tokenizer.pad_token_id
        P = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), P), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, P - len(p):] = 1
        recorder = SampledTokenLogprobs(params.temperature) if params.logprobs else None
        # synced_gpus=False: the trainer generates with every parameter present on this rank (the update backend's
        # ``generation`` context), so no rank needs the others to keep stepping. transformers' default for an FSDP
        # model all-reduces "finished?" at every token, which hangs when ranks make different numbers of calls
        # (their shares of an evaluation).
        res = self.model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=gen_cfg,
                                  logits_processor=LogitsProcessorList([recorder]) if recorder else None,
                                  synced_gpus=False)
        seqs = res.sequences[:, P:]  # (len(chunk)*n, C)
        logprobs = recorder.finish(seqs[:, -1]).cpu() if recorder and seqs.shape[1] else None
        seqs = seqs.cpu()
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
                prompt_ids=chunk[r // params.n],
                token_ids=row[:length].tolist(),
                logprobs=logprobs[r, :length].tolist() if logprobs is not None else None,
                truncated=truncated,
            ))
        return completions
