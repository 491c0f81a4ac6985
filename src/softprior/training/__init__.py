"""Training: the loop for one run or a group of K (``loop``), the group engine that stacks K runs of one
shape (``engine``), and the process's runtime settings (threads, allocator; ``runtime``)."""
