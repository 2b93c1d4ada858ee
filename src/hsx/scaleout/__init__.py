"""Scale-out: many Ray workers (one per GPU, on one or many nodes) extract one run.

``registry`` (the workers' heartbeat files in the run folder; no Ray, read by ``hsx status``),
``worker`` (the Ray Data pool actor: whole shards through the single-process capture -> store path),
``driver`` (``hsx extract --workers N``: holds the run lock, hands out shard ids, tallies). Only
``driver`` and ``worker`` import Ray, and only when ``--workers`` is used.
"""
