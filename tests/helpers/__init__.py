"""What the tests share besides fixtures (the fixtures stay in tests/conftest.py). pytest puts tests/ on the path,
so a test imports ``helpers.<module>``; a child process gets the same with ``PYTHONPATH=tests``. A test never
imports another test file (tests/test_suite_rules.py): what a second file needs moves here.

    compose      compose the real config tree as ``python -m grail_exp.<entry point>`` does, with temp paths
    tolerances   floating-point tolerances derived from the computation, and the hang bound of subprocesses and waits
    models       the tiny test model's build
    fakes        deterministic stand-ins: rollout engines (``rollout.engine=helpers.fakes:ScriptedEngine``), a verifier
    pinned_step  the fixed batch, configuration and recorded numbers of tests/test_pinned_step.py, and the training
                 module around that batch
    module       the training module on a local tiny model without the Lightning Trainer: a short config, the
                 build, one optimiser step
    batches      scheme batches of a few arithmetic problems, as the weights CLI or the trainer builds them
    architectures  the package's architecture files and a model's parameter count written out by hand
    scripted_run ``python -m grail_exp.run`` in a child process with the scripted engine: 1 process vs N gloo ranks
    card_probe   the probe every rank of the card's rehearsal loads (``GRAIL_EXP_PROBE=helpers.card_probe:CardProbe``)
    checkpoint_probe  the checkpoint tests' probes (host memory of a write, a digest of the restored state)
    probe_writer the probes' common base: one JSON line per point and rank
    greedy       two engines' greedy completions compared token by token, up to a near-tie of the argmax
    emulate_avx2 not a module: a folder whose ``sitecustomize`` makes vLLM choose the kernels of a CPU without AVX-512
                 when put on ``PYTHONPATH`` (emulating another CPU: docs/developer.md, "Tests that sample")

This ``__init__`` imports nothing, so a child process that loads one helper pays for no other.
"""
