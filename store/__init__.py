"""rlrec's on-storage model, shared by the consumer (writer) and the trainer (reader).

`storage` (a pyarrow filesystem with create-once writes), `manifest` (the per-partition commit
log) and `manifest_entries` (its entries), `finished` (the episode hand-off between assembly and shard writing),
`episodes` and `shards` (the shard formats and their safe readers), `commit` (the shard commit
protocol: stage, append, publish), `maintenance` (inspect, verify, gc). Imports only
`rlrec.producer` of ours; Ray only where an RLlib object is built.
"""
