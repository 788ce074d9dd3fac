"""What the tests share besides fixtures (the fixtures stay in tests/conftest.py). pytest puts tests/ on the path,
so a test imports ``helpers.<module>``; a child process gets the same with ``PYTHONPATH=tests``.

    compose      compose the real config tree as ``python -m grail_exp.<entry point>`` does, with temp paths
    tolerances   floating-point tolerances derived from the computation, and the hang bound of subprocesses and waits
    models       the tiny test model's build
    fakes        deterministic stand-ins: rollout engines (``rollout.engine=helpers.fakes:ScriptedEngine``), a verifier
    pinned_step  the fixed batch, configuration and recorded numbers of tests/test_pinned_step.py
    scripted_run ``python -m grail_exp.run`` in a child process with the scripted engine: 1 process vs N gloo ranks
    card_probe   the probe every rank of the card's rehearsal loads (``GRAIL_EXP_PROBE=helpers.card_probe:CardProbe``)

This ``__init__`` imports nothing, so a child process that loads one helper pays for no other.
"""
