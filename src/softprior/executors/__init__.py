"""Sweeps: run a list of run configs, one job at a time or many at once. Import each name from the
module that defines it (this package re-exports nothing):

- ``sweep``: the driver (``execute``; ``run``, a sweep of one; ``sweep_plan``; ``SweepReport``,
  ``RunFailedError``): the only part that touches the store;
- ``job``: one job, a run or a group trained together (``work``, ``JobResult``), pure but for its
  checkpoint files;
- ``backends``: where the jobs run: in this process, a local process pool, or Ray;
- ``grouping``: which runs share a job, and the group size (``--group auto``: ``group_sizes``, the
  measured scaling tables);
- ``progress``: the sweep's progress bar;
- ``ledger``: the store's time ledger rows, per job and per sweep;
- ``environment``: the environment variables the executors read (``SettingError``).
"""
