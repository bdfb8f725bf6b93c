"""The one exception type kvstore raises to its callers (start-up and configuration faults).

Run-time I/O faults (corrupt files, full disk, races) are never raised: they become misses
and counters.
"""


class KVStoreError(Exception):
    """A KV store cannot start or is misconfigured; the message names the path and reason."""
