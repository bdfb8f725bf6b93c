"""kvstore: the host-RAM and disk tiers of the KV cache, their TTL and integrity.

Stores opaque bytes (no torch). Imports nothing else of Duplex.

  keys       the content address of a block (one versioned function for every cache)
  retention  chat / agent retention classes and expiry
  entry      BlockEntry: one block's payload and small header
  host       HostTier: RAM, byte-bounded LRU
  blockfile  the on-disk format of one block file, blocking file operations
  disk       DiskTier: files, write-behind queue, LRU cap, TTL sweep, restart index
  store      KVStore: host in front of disk (spill, promote, lookup, flat stats)
  errors     KVStoreError
"""
