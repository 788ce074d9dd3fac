"""One training step, by phase (design.md, "Data flow of one training step").

    rollout phase  (rollout.py)   prompts → G completions each → rewards → advantages → TrainingBatch (batch.py)
    update phase   (update.py)    TrainingBatch → micro-batches → token weights → loss → gradients → optimiser step
    update backend (backends/)    how gradients become an update under one strategy: single process / DDP, FSDP, ZeRO
    records        (records.py)   what a step leaves behind besides the update: weight and sample tables, progress lines
    run state      (state.py)     what exact resume needs: counters, RNG streams, a half-used rollout batch, optimiser
    module         (module.py)    the LightningModule ``RLVRModule``: calls the phases in order, logs, calls the hooks
    job            (job.py)       the whole run: build the parts, fit, evaluate, checkpoint (``python -m grail_exp.run``)

This package's ``__init__`` imports nothing, so any of its files can be imported on its own.
"""
