"""Scale-out: many Ray workers (one per GPU, or per tensor-parallel group; on one or many nodes)
extract one run: the ``Workers`` executor of ``extract.executor``.

``driver`` (``hsx extract --workers N``: holds the run lock, hands out shard ids, folds each shard's
``Outcome``), ``actor`` (the Ray Data pool actor), ``worker`` (``ShardRunner``: whole shards through
the single-process capture -> store path), ``group`` (a worker whose replica is a tensor-parallel
group). The workers' heartbeat files, which ``hsx status`` reads without Ray, are ``hsx.registry``.
Ray is imported only when ``--workers`` is used.
"""
