"""The store: hsx's integrity mechanism, in one place.

- ``durable``: the only way a file reaches its final name (temp file, fsync, rename, folder fsync).
- ``format``: the per-sample safetensors file, self-verifying through a digest in its header.
- ``layout``: where each sample id lives, independent of workers and ranks.
- ``writer``: writes samples from host buffers, many at once, and seals finished shards.
- ``scan``: classifies what is on disk (ok, missing, truncated, corrupt, misplaced, stray).
"""
