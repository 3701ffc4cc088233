"""rlrec consumer: episode assembly, shard writing, manifest."""
