"""The run store's errors."""


class StoreError(RuntimeError):
    pass


class RunNotFoundError(StoreError):
    pass
