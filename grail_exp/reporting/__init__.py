"""The paper's table from MLflow runs or a study folder, with paired statistics against a baseline: the library of
``python -m grail_exp.report`` (grail_exp/report.py, the entry point).

    python -m grail_exp.report runs.parent_run_id=<id of a sweep's parent run>
    python -m grail_exp.report +runs.tags.task_name=paper_table output.name=paper_table_cpu
    python -m grail_exp.report 'runs.run_ids=[<id>,<id>,...]' baseline=grpo 'metrics=[acc,pass@3]'
    python -m grail_exp.report runs.dir=results/real_model_study/<study> design_check.strict=true   # a study folder

Rows are model × scheme, columns the benchmarks and their average (unweighted over benchmarks, as the GRAIL paper
reports), one table per metric (acc@n, pass@k, maj@n). Every non-baseline cell carries its Δ against the
baseline scheme trained on the same model and seeds; a second table gives each Δ with its paired 95 % interval,
the spread of the per-seed Δ, the seed-level tests that decide a star (paired t over seeds and the exact seed
sign-flip, with the smallest p it can reach; Holm-adjusted outside the declared ``primary_metric``) and the
per-problem sign-flip p ("these trained models only"); then each arm's truncation rate and mean completion length
(statistics: grail_exp/analysis/stats.py).

**Where the numbers come from.** Each training run's final evaluation logs its per-sample results
(``eval/final/samples.parquet``: benchmark, problem_index, sample_index, correct, extracted, ...). The report reads
them back, computes per-problem values (c/n for acc, the unbiased pass@k, majority vote), and pairs arm X with the
baseline by (seed, benchmark, problem_index): both arms of a seed answered the same problems, sampled from the same
per-chunk seeds (common random numbers, grail_exp/evaluate.py), so per-problem differences cancel most of the
sampling noise.

**A study folder** (``runs.dir``, written by training jobs with ``study.dir`` set, grail_exp/analysis/study.py) stands in for
MLflow: each finished arm's ``arm.json`` (model, scheme, seed, flat configuration, starting weights' sha256),
``samples_final.parquet``, ``history.csv`` and ``weights/`` give the same table and plots, from files that can be
committed with the results.

**A study that is not one is refused** with ``design_check.strict=true``: arms of a model must agree on every key
of ``design_check.same_everywhere`` (evaluation, data, budget, optimiser, ...), the arms of a seed on
``design_check.same_within_seed`` (starting weights, training order) and the arms of a scheme on
``design_check.same_within_scheme`` (``advantage.*``); a key an older arm lacks counts as its schema default; seeds
outside ``seeds`` are not allowed (without ``seeds``, every non-baseline seed needs its baseline run; with them, a
declared seed still missing arms is footnoted, not refused). The error names each key, its values and the runs that differ.
Without it, differing evaluation settings are footnoted (``pairing_params``).

**Nothing is dropped silently.** A run that is not FINISHED, has no per-sample artifact, lacks a benchmark, or has
no baseline partner for its seed is named in a lettered footnote, and the cells it would have filled read "—" or
say which seeds they use. Unpaired cells (no common seed) show the arm's value with "Δ —".

The modules, in the order the report runs them: ``schema.py`` (the configuration and ``validate_report``),
``runs.py`` (which runs, their per-sample results and per-problem values, the design check), ``tables.py`` (cells,
rows and paired Δs per metric), ``decisions.py`` (the primary comparison, the declared rule, Holm, the spread and
pooled sections), ``render.py`` (Markdown, LaTeX, JSON), ``figures.py`` (plots across runs) and ``build.py``
(``build_report``: all of it, the files and the MLflow logging).
"""
