"""The killable process pool on its own (grail_exp/grading/pool.py), with a job that is not grading: the pool must
return each job's reply in input order and fail only the job that overran its deadline or killed its worker.
(tests/test_rewards.py checks it under the grader: queued answers, pipelining, counters.)"""

from __future__ import annotations

from grail_exp.grading.pool import Failed, WorkerPool

# A real job here needs microseconds; 5 s of wall time leaves room on a machine loaded many times over. The sleeping
# job never ends on its own during the test: it comes back "timeout" only because the pool killed its worker.
POOL_HARD_S = 5.0
SLEEP_S = 600


def test_the_pool_runs_any_picklable_function_and_fails_only_the_overrunning_or_crashed_job():
    # eval is a builtin, so it pickles by name under spawn: each job is one expression.
    pool = WorkerPool(eval, num_workers=2, hard_timeout_s=POOL_HARD_S, name="test")
    try:
        jobs = [("2 + 3",), (f"__import__('time').sleep({SLEEP_S})",), ("__import__('os')._exit(3)",), ("6 * 7",),
                ("'a' * 3",)]
        assert pool.run(jobs) == [5, Failed("timeout"), Failed("error"), 42, "aaa"]
        assert pool.worker_restarts == 2
        assert pool.run([("1",)]) == [1]  # the replacements work
        processes = [w.process for w in pool.workers]
    finally:
        pool.close()
    assert all(not p.is_alive() and p.exitcode is not None for p in processes)  # exited and reaped
