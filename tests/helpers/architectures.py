"""The package's architecture files and a model's parameter count written out by hand from one, for the memory
planner's tests (the planner counts parameters its own way; this count is the independent reference)."""

from __future__ import annotations

import json
from pathlib import Path

ARCHITECTURES = Path(__file__).resolve().parents[2] / "grail_exp" / "data" / "architectures"


def architecture(name: str) -> dict:
    """The architecture file ``grail_exp/data/architectures/<name>.json`` (a Hugging Face config)."""
    c = json.loads((ARCHITECTURES / f"{name}.json").read_text())
    assert not c.get("attention_bias") and not c.get("mlp_bias")  # the count below has no biases
    return c


def parameter_count(c: dict) -> int:
    """Parameters of a Llama / Qwen3 decoder without biases: attention, SwiGLU MLP, norms, embeddings (and head)."""
    h, i, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attention = h * nh * d + 2 * h * nkv * d + nh * d * h  # q, k, v, o
    layer = attention + 3 * h * i + 2 * h + (2 * d if c["model_type"] == "qwen3" else 0)  # SwiGLU, 2 norms, q/k norms
    return c["num_hidden_layers"] * layer + V * h * (1 if c["tie_word_embeddings"] else 2) + h
