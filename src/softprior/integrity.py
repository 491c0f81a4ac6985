"""``softprior store verify``: moved into the store package (``softprior.store.integrity``), which owns
every file under the store; re-exported here for compatibility."""

from .store.integrity import REQUIRED_FILES, Problem, VerifyReport, verify_store

__all__ = ["verify_store", "VerifyReport", "Problem", "REQUIRED_FILES"]
