"""The model: its configuration (``config``), the readable soft-prior Transformer (``transformer``), the
prior families of B^pos (``priors``), the thirteen positional baselines as model and path settings
(``baselines``), and the fast path that trains K runs of one shape at once (``fastpath``)."""
