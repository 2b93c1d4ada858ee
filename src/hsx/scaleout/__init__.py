"""Scale-out: many Ray workers (one per GPU, on one or many nodes) extract one run.

``worker`` (the Ray Data pool actor: whole shards through the single-process capture -> store path),
``driver`` (``hsx extract --workers N``: holds the run lock, hands out shard ids, tallies). The
workers' heartbeat files, which ``hsx status`` reads without Ray, are ``hsx.registry``. Ray is
imported only when ``--workers`` is used.
"""
