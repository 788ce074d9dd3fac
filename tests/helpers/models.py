"""The tiny test model: a 2-layer Qwen3 over the embedded arithmetic tokenizer (vocabulary 320), built in seconds
(conftest's ``tiny_model_dir`` / ``formatted_model_dir`` fixtures; child processes build it from the same dict)."""

TINY_BUILD = dict(architecture="qwen3", tokenizer="qwen", vocab_size=320, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=True)
