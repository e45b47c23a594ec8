"""The test suite, a package so that test modules import their helpers by package path
(``from tests import rankpool``, ``from tests.store import store_agents``) with the
repository root on ``sys.path`` (pytest's ``pythonpath = ["."]``; rank processes and
helper subprocesses get it through ``PYTHONPATH``).

Layout: ``pg/`` (the process group), ``ep/`` (expert parallelism), ``store/`` (the
tensor store, WeightSync, KVCacheStore), ``integration/`` (demo, launcher, two hosts),
``device/`` (checks run on a GPU machine by ``device/run_gpu_checks.sh``); shared
helpers here: ``rankpool`` (the rank-process pool) and ``faults`` (killing processes).
"""

import os

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
