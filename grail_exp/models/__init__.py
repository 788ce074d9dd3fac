"""The policy's weights and tokenizer: loading (hub, local, packaged, embedded), architectures, random initialisation, the supervised cold start."""
