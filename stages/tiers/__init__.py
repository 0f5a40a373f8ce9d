"""KV tiers below the device pool: the offload mover, its queue, block I/O through
zero-copy views, and the compressed disk tier."""
