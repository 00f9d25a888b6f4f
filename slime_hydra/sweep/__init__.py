"""``python run.py -m ...``: sweeps as an experiment runner, plugged into Hydra's sweeper and launcher seams
(``conf/hydra/sweeper/``, ``conf/hydra/launcher/``): ``sweeper.py`` and ``optuna.py`` validate every job
first and resume a sweep, ``launcher.py`` runs jobs concurrently on one Ray cluster (``cluster.py``), and
``report.py`` writes ``sweep.csv``, ``sweep.md`` and ``sweep_curves.png`` as jobs end."""
