"""Tolerances (docs/notes/reliability.md) and the one hang bound.

Two fp32 computations of one quantity that sum in another order (another batch shape or fast path, another CPU's
GEMM blocking, another thread count) differ; exact equality only where the code path is bit-identical by
construction. A length-n reduction in another order moves its result by at most n * eps relative to the sum of its
terms' magnitudes; the longest reduction in the test models is their vocabulary.
"""

FP32_EPS = 2.0 ** -23
REORDER = 320 * FP32_EPS  # 3.8e-5: one reordered reduction of length <= V = 320
# A model output (log-prob, hidden state, saliency, gradient entry) passes ~5 reductions in a row (attention and MLP
# of the layers, the head, the log-softmax), each moving it by <= REORDER relative to its terms' scale.
MODEL_REORDER = 5 * REORDER  # 1.9e-4

# Timeouts of subprocesses and waits in the tests only guard against a hang; they never measure speed: a command that
# takes 10 s on an idle 2-core machine takes minutes while other jobs load it. One generous bound for all of them.
HANG_TIMEOUT_S = 1200
