"""``python -m grail_exp.report``: the paper's table from MLflow runs, with paired statistics against a baseline.

    python -m grail_exp.report runs.parent_run_id=<id of a sweep's parent run>
    python -m grail_exp.report +runs.tags.task_name=paper_table output.name=paper_table_cpu
    python -m grail_exp.report 'runs.run_ids=[<id>,<id>,...]' baseline=grpo 'metrics=[acc,pass@3]'
    python -m grail_exp.report runs.dir=results/real_model_study/<study> design_check.strict=true   # a study folder

The report itself (run selection, the design check, tables, decisions, rendering, plots) is grail_exp/reporting/
(docs/report.md); this entry point composes conf/report.yaml and runs ``build_report``.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from grail_exp.conf_path import CONFIG_DIR
from grail_exp.reporting import schema  # noqa: F401  stores report_schema, which conf/report.yaml extends


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="report")
def main(cfg: DictConfig) -> None:
    from grail_exp.errors import exit_on_user_error
    from grail_exp.reporting.build import build_report

    with exit_on_user_error():
        build_report(cfg)


if __name__ == "__main__":
    main()
