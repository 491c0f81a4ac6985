"""Calibration as a search: task design and initialisation chosen by the paper's
difficulty rows alone, pre-registered, then a robustness map of the paper's claims.

- ``criteria``: the difficulty criteria, as data (the claims: ``softprior.claims``);
- ``space``: search spaces (TOML / JSON, pydantic-validated; shipped defaults in ``spaces/``);
- ``search``: the Optuna search over candidates, run through the project's executors;
- ``register``: pre-registration records and the store's refusal of unregistered prediction rows;
- ``robustness``: the prediction rows of every passing candidate, the claim counts.

What is written from them (the table, the figure, the registered record and the blocks of
``docs/CALIBRATION.md``) lives with the other report writers: ``softprior.reports.calibration`` and
``softprior.reports.calibration_doc``.
"""
