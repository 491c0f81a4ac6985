"""What is written from the run store (or a results bundle): tables, figures and documents. Import
each name from the module that writes it (this package re-exports nothing):

- ``experiment``: an experiment's table, figures and notes (``softprior report``, the end of
  ``reproduce``), and the splicing of a table into a markdown document;
- ``calibration``: a calibration search's candidates table and figure;
- ``calibration_doc``: a search's registered record (pre-registration) and the generated blocks of
  ``docs/CALIBRATION.md``;
- ``study``: the report of ``softprior study`` (``study/NAME/REPORT.md``);
- ``atlas``: the removability atlas of ``softprior atlas`` (``docs/ATLAS.md`` and its figure, from the cells' files);
- ``timings``: the time ledger summed up and said as text (``softprior report timings``).

They lie above ``calibration/`` and below the drivers that call them (``paper.py``, ``study.py``, the
command line). The mechanism and continuation reports that an experiment names as its analysis lie
below the experiments, in ``softprior.analysis.reports``; RESULTS.md is written by the paper's driver
(``paper.write_results_doc``).
"""
