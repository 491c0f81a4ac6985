"""The ``softprior`` command line. Every command calls the same library functions as the Python API.

Errors (``main``): bad input gets one line, ``softprior: error: ...``, naming the bad value and the
allowed ones or the command that fixes it, and exit code 2; a failure our code finds and explains (a
damaged run, a run whose training failed) gets one line too, and exit code 1. Only our own error
classes are read so (``_BAD_INPUT``, ``_FAILURES``): anything else is a bug or an unforeseen failure,
and shows its traceback (exit code 1) rather than pass for a user's mistake.

Start-up: building the parser imports nothing heavy, and each command imports what it needs, so
``--help`` and ``paths`` answer without importing torch (seconds on a loaded machine).

This module holds the parser and the dispatch (``build_parser``, ``main``); each family of commands
lives in a module of its own, with its parser:

- ``train``: ``train`` and ``eval`` (one run);
- ``reproduce``: ``reproduce`` and ``report`` of an experiment;
- ``paper``: ``reproduce paper`` and ``report paper`` (every experiment, the documents, the bundle);
- ``timings``: ``report timings`` (the store's time ledger);
- ``calibrate``: ``calibrate`` (the search, pre-registration, the robustness map);
- ``tools``: ``experiments``, ``baselines``, ``bench`` and ``export``;
- ``listings``: ``store verify``, ``paths`` and ``tasks``;
- ``tour``: ``tour``; ``study``: ``study``; ``atlas``: ``atlas`` (a study per prior family and task, ATLAS.md);
- ``common``: the command line's errors, argument types and what several commands share;
- ``outputs``: the output paths checked before a command works, and the reports' ledger rows.
"""

from __future__ import annotations

import argparse
import sys

from .atlas import _add_atlas_parser
from .calibrate import _add_calibrate_parser
from .listings import _add_store_and_listing_parsers
from .reproduce import _add_experiment_parsers
from .study import _add_study_parser
from .tools import _add_tool_parsers
from .tour import _add_tour_parser
from .train import _add_eval_parser, _add_train_parser

__all__ = ["main"]


def _one_line(msg: str) -> str:
    """``msg`` with every non-printable character (newlines included) escaped as ``repr`` does, so an
    error is always one line, whatever the user typed."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(msg))


class _HelpFormatter(argparse.HelpFormatter):
    """Fills ``{model_presets}`` in a help text when help is shown: the presets live beside the model,
    which imports torch, and building the parser must not."""

    def _get_help_string(self, action):
        text = super()._get_help_string(action)
        if "{model_presets}" in text:
            from ..model.config import MODEL_PRESETS
            text = text.replace("{model_presets}", ", ".join(MODEL_PRESETS))
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line, ``softprior: error: ...``, exit code 2
    (argparse's default prints the usage block first)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"softprior: error: {_one_line(message)} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line: each command (or family of commands) adds its own parser."""
    p = _Parser(prog="softprior", description="Annealable soft-prior Transformers: train, "
                                "evaluate and reproduce circuit-removability experiments.")
    sub = p.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_eval_parser(sub)
    _add_experiment_parsers(sub)
    _add_calibrate_parser(sub)
    _add_tool_parsers(sub)
    _add_store_and_listing_parsers(sub)
    _add_tour_parser(sub)
    _add_study_parser(sub)
    _add_atlas_parser(sub)
    return p


# Our own error classes, by module and name: looked up in sys.modules, so telling them apart imports
# nothing (an error whose module was never imported cannot have been raised). A failure is tried first
# (StoreDamagedError is a StoreError).
_FAILURES = (("softprior.cli.common", "CliFailure"), ("softprior.store.errors", "StoreDamagedError"),
             ("softprior.executors.sweep", "RunFailedError"), ("softprior.tour", "TourError"))
_BAD_INPUT = (("softprior.cli.common", "CliError"), ("pydantic", "ValidationError"),
              ("softprior.store.errors", "StoreError"),  # a run or store not there, a store not writable
              ("softprior.paths", "UnknownPathError"), ("softprior.tasks.registry", "UnknownTaskError"),
              ("softprior.model.config", "UnknownModelError"), ("softprior.model.baselines", "UnknownBaselineError"),
              ("softprior.positional.base", "UnknownSchemeError"),
              ("softprior.experiments", "UnknownExperimentError"), ("softprior.experiments", "UnknownTaskFilterError"),
              ("softprior.plugins", "PluginError"), ("softprior.calibration.space", "SpaceError"),
              ("softprior.study", "StudyError"), ("softprior.model.priors", "UnknownPriorError"),
              ("softprior.preregistration", "CalibrationMissing"),  # and RecordRefused, a subclass
              ("softprior.preregistration", "UnknownRecordError"),
              ("softprior.reports.experiment", "DirtyRunsRefused"), ("softprior.executors.environment", "SettingError"),
              ("softprior.interop", "ExportError"), ("softprior.interop", "MissingExtraError"))


def _is(e: BaseException, classes) -> bool:
    return any(isinstance(e, c) for mod, name in classes
               if isinstance(c := getattr(sys.modules.get(mod), name, None), type))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "steps", None) is not None and args.steps < 1:
        print(f"softprior: error: --steps must be a positive integer, got {args.steps}", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except KeyboardInterrupt as e:  # a training loop says where its runs resume (loop.DeferredInterrupt)
        print("softprior: interrupted" + (f": {_one_line(str(e))}" if str(e) else ""), file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - sorted below: ours in one line, anything else with its traceback
        code = 1 if _is(e, _FAILURES) else 2 if _is(e, _BAD_INPUT) else None
        if code is None:
            import traceback
            traceback.print_exc()
            print(f"softprior: unexpected {type(e).__name__} (not an input error; the traceback above shows where)",
                  file=sys.stderr)
            return 1
        if _is(e, [("pydantic", "ValidationError")]):
            from ..config import validation_message
            msg = f"invalid configuration: {validation_message(e)}"
        else:
            msg = str(e)
        print(f"softprior: error: {_one_line(msg)}", file=sys.stderr)
        return code
