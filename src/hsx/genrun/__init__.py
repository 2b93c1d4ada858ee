"""A generate run as data, beside the spec: what ``extract`` and ``assess`` read of a generate run
without the generate stage (``hsx.generate``), and what that stage writes.

- ``spec``: its spec (``GenerateSpec``, kind ``generate``), its drift check, ``load_any`` (the spec of
  a run of either kind, by the kind it records);
- ``plan``: its frozen input plan (written once, read back, checked against the spec);
- ``record``: one conversation's file (the target's turns as token ids and text), its header's status;
- ``samples``: a generate run as an extraction's input (samples of its token ids, rejects with reasons).

Its folder's names are ``store.layout``'s, as every run folder's.
"""
