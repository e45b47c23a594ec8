"""Expert-parallel tests (``mooncake_ep``)."""
