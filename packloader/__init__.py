"""packloader: token shards in, packed batches out (sources, pre-packing, reports, PackedDataLoader, CLI)."""
