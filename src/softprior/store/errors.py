"""The run store's errors. The command line shows each as one line: a store or run the user named
that is not there, or a store it may not write, is bad input (exit 2); damage found while reading is
a failure (exit 1) whose message names the command that checks and repairs the store."""


class StoreError(RuntimeError):
    pass


class RunNotFoundError(StoreError):
    pass


class StoreNotFoundError(StoreError):
    """No store at the given root (commands that only read never create one: a typo in --store)."""


class StoreReadOnlyError(StoreError):
    """A write asked of a store opened read-only (its directory cannot be written, or ``read_only=True``)."""

    @classmethod
    def at(cls, root) -> "StoreReadOnlyError":
        return cls(f"store {str(root)!r} is open read-only: the commands that read it (eval, report, export, "
                   "store verify) work; to train, give a writable --store")


class StoreDamagedError(StoreError):
    """A finished run's files or the index cannot be read as written."""
