"""``rollout=hf``: sampling with transformers ``generate`` (KV cache) on the policy itself.

Shares the policy's weights, so ``sync_weights`` has nothing to do. Log-probs are taken from the
*processed* scores (after temperature / top-k / top-p), i.e. the distribution the token was actually
drawn from. The model's own ``generation_config`` is ignored on purpose: every sampling knob comes
from our config, so a checkpoint's defaults (Qwen3 ships T=0.6, top_k=20) never leak in.
"""

from __future__ import annotations

import torch

from grail_exp.rollout.base import Completion, SamplingParams


class HFRolloutEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256, stop_token_ids: list[int] | None = None,
                 return_logprobs: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # completions per generate() call
        stops = stop_token_ids or [tokenizer.eos_token_id]
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in stops:
            stops = [*stops, tokenizer.pad_token_id]  # a completion that emits the pad token has ended too
        self.stop_token_ids = stops
        self.return_logprobs = return_logprobs

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
            output_scores=self.return_logprobs,
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
        pad = self.tokenizer.pad_token_id
        P = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), P), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, P - len(p):] = 1
        res = self.model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=gen_cfg)
        seqs = res.sequences[:, P:].cpu()  # (len(chunk)*n, C)
        logprobs = None
        if self.return_logprobs and res.scores:
            scores = torch.stack(res.scores, dim=1).float()  # (N, C, V) processed scores
            logprobs = torch.log_softmax(scores, dim=-1).gather(-1, seqs.unsqueeze(-1).to(scores.device)).squeeze(-1).cpu()
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
