"""Two engines' greedy completions compared token by token, up to a near-tie of the argmax.

Two fp32 forwards in different kernels (vLLM's CPU build and transformers, another batch shape, another CPU's GEMM
blocking) give logits that differ by up to ``MODEL_REORDER`` of their scale (tests/helpers/tolerances.py). Where the
two largest logits of a step are closer than twice that, either token is a correct greedy choice, and which one an
engine picks depends on the processor: the fixture models' greedy paths have top-2 gaps down to 7e-5 (measured), one
such step in a few hundred. So the rows are compared up to their first difference, and that difference must be such a
tie in a third forward (the model's own full-sequence forward on the shared prefix); anything else fails.
"""

from __future__ import annotations

import torch

from helpers.tolerances import MODEL_REORDER


def assert_same_greedy(model, ours: list, theirs: list, min_tokens: int = 20) -> int:
    """Every row of ``ours`` equals the same row of ``theirs`` (Completion lists, same prompts) up to a step whose
    greedy choice is a near-tie in ``model``'s forward; at least ``min_tokens`` tokens compared equal. Returns that
    number."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    equal = 0
    for r, (a, b) in enumerate(zip(ours, theirs)):
        assert a.prompt_ids == b.prompt_ids, r
        k = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if k is None:
            assert a.token_ids == b.token_ids and a.truncated == b.truncated, (r, a.token_ids, b.token_ids)
            equal += len(a.token_ids)
            continue
        with torch.no_grad():
            z = model(input_ids=torch.tensor([a.prompt_ids + a.token_ids[:k]])).logits[0, -1].float()
        gap = (z[a.token_ids[k]] - z[b.token_ids[k]]).abs().item()
        # each engine's logits are within MODEL_REORDER x scale of this forward's: a gap above twice that is a real
        # difference of the engines' distributions, not rounding
        tie = 2 * MODEL_REORDER * z.abs().max().item()
        assert gap <= tie, (f"row {r} differs at token {k} ({a.token_ids[k]} vs {b.token_ids[k]}) where the greedy "
                            f"choice is no tie: logit gap {gap:.3g} > {tie:.3g}", a.token_ids, b.token_ids)
        equal += k
    assert equal >= min_tokens, f"only {equal} tokens compared: not a real comparison"
    return equal
