"""``python -m grail_exp.preflight``'s command line: the options, the two runs, the table, the exit code (the package's
docstring says what it does)."""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the run's overrides, the ``preflight.*`` ones)."""
    mine = [a for a in argv if a.lstrip("+").startswith("preflight.")]
    return [a for a in argv if a not in mine], [a.lstrip("+") for a in mine]


def options(overrides: list[str]):
    """The ``preflight.*`` options (grail_exp/config.py ``PreflightConfig``), validated."""
    from omegaconf import OmegaConf

    from grail_exp.config import PreflightConfig
    from grail_exp.validate import validate_preflight

    opts = OmegaConf.merge(OmegaConf.structured(PreflightConfig),
                           OmegaConf.from_dotlist([o.removeprefix("preflight.") for o in overrides]))
    validate_preflight(opts)
    return opts


def main(argv: list[str] | None = None) -> int:
    from grail_exp.distributed import export_local_rank
    from grail_exp.preflight.checks import run_checks
    from grail_exp.preflight.rehearsal import Rehearsal
    from grail_exp.preflight.report import exit_code, render

    export_local_rank()  # before the rehearsal's validate() plans against a device (grail_exp/memory/nvml.py)
    run_args, mine = split_argv(list(sys.argv[1:] if argv is None else argv))
    opts = options(mine)
    where = Path(opts.dir or f"preflight-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    rehearsal = Rehearsal(run_args, opts, where)
    ev = rehearsal.run()
    header = [f"preflight of: python -m grail_exp.run {' '.join(run_args)}",
              f"rehearsal in {where} (commands and logs: train.cmd/.log, resume.cmd/.log)",
              f"{ev.world} rank(s), {ev.layers_run} of {ev.layers_full} decoder layers; full depth = measured "
              f"{ev.formula}",
              f"final evaluation: {rehearsal.eval_limit} problems per benchmark ("
              + ("preflight.eval_limit" if rehearsal.opts.eval_limit is not None else
                 "the fewest, at least 4, that give every rank a chunk") + ")"]
    if rehearsal.dropped:
        header.append(f"overrides the rehearsal sets itself (ignored): {' '.join(rehearsal.dropped)}")
    for name, run in (("training", ev.train), ("resumed", ev.resume)):
        if run is not None and run.returncode not in (0, 143) and run.log_tail:
            print(f"the {name} run exited {run.returncode}; the end of its log:\n{run.log_tail}\n", flush=True)
    results = run_checks(ev)
    text = render(results, header + [""])
    print(text, flush=True)
    (where / "preflight.md").write_text(text + "\n")
    return exit_code(results)


@contextmanager
def stops_end_the_rehearsal():
    """SIGTERM and SIGINT (``timeout``, Ctrl-C, SLURM) end the preflight through its ``finally`` blocks, which end the
    rehearsal's process group (``Rehearsal._end_group``): without this a SIGTERM killed the preflight outright and left
    the run's ranks behind, orphaned. One line; exit 128 + the signal."""
    from grail_exp.preemption import exit_code, exit_now, signal_name

    class Stopped(BaseException):
        pass

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the way out must not be interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except Stopped as stop:
        signum = stop.args[0]
        print(f"preflight stopped by {signal_name(signum)}: the rehearsal's processes were ended", file=sys.stderr,
              flush=True)
        exit_now(exit_code(signum))
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
