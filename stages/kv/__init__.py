"""The KV service: the paged pool (bytes), its books (`BlockManager`: refcounts, prefix
cache, host tier) and the cache kinds mlx-lm models declare."""
