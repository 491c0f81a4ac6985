"""Mechanistic diagnostics: what a circuit is and when it forms (``mechanism``: attention patterns,
value contributions, mean ablation, the successor-value mass and the mechanism trace), the paper's
continuation view (``continuation``), and the reports an experiment writes from them (``reports``)."""
