"""The extraction job, stage by stage:

- ``options``: what the operator asked for (``ExtractOptions``), parsed once, defaults in one place;
- ``folder``: create a run (plan, rejects, spec last) or open one and refuse any drift from its spec;
- ``resume``: verify what is on disk, tidy what a crash left, settle finished shards (the one
  resume prologue, used by the local job, the scale-out driver and workers, and the vLLM path);
- ``pipeline``: one process's capture -> staging -> writer pipeline (``Extractor``);
- ``local``: the single-process job that ties them together.
"""
