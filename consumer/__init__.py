"""rlrec consumer: the Kafka loop, episode assembly and shard writing (storage model: `rlrec.store`)."""
