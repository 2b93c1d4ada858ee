"""Recovery assessment: what is intact in a run, and whether resuming is safe, with figures.

One idea per module: ``gpus`` (who holds the accelerators), ``volume`` (space and the disk guard),
``tally`` (progress per shard), ``integrity`` (files on disk), ``model`` (weights and capture),
``runspec`` (spec and plan), ``workers`` (lock, heartbeat, metrics); ``status`` assembles the
checklist and ``verify`` is the integrity part alone, with repair. Nothing here loads the model.
"""
