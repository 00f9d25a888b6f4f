"""``python run.py -m ...``: sweeps as an experiment runner.

Hydra splits a sweep into a sweeper (which jobs) and a launcher (where they run); slime_hydra plugs into
both seams (``conf/hydra/sweeper/``, ``conf/hydra/launcher/``) instead of wrapping ``run.py`` in a loop:

- ``sweeper.SlimeSweeper`` (Hydra's basic sweeper) and ``optuna.SlimeOptunaSweeper`` (hydra-optuna-sweeper)
  compose and validate every job before the first one starts (``compose.py``), and resume a sweep;
- ``launcher.SweepLauncher`` (hydra-joblib-launcher) runs up to ``sweep.max_concurrent`` jobs at once, each
  its own Ray driver joined to ONE Ray cluster (``cluster.py``), so placement groups queue for resources;
- ``report.py`` writes ``sweep.csv``, ``sweep.md`` and ``sweep_curves.png`` into the sweep directory as
  jobs end (``python -m slime_hydra.sweep report DIR`` rebuilds them) and prints one status line per job.
"""
