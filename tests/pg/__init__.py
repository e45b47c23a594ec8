"""Process-group tests: conformance, bad input, fault tolerance, rejoin, integration with
torch.distributed, build and GPU-path checks."""
