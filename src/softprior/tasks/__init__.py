"""The tasks: their configs and the task registry (``registry``: no torch), and their generators, Bayes
ceilings and losses (``generators``)."""
