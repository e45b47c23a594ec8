"""What every part of ``mooncake_store`` shares.

Errors (``errors.py``), the metadata RPC's wire format (``protocol.py``), the environment and
addresses (``config.py``), the segment layout (``layout.py``) and the store cluster's keys in etcd
(``etcd.py``).
"""
