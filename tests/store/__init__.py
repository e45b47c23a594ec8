"""Store tests (``mooncake_store``: the store, WeightSync, KVCacheStore)."""
