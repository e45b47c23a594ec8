"""``python -m mooncake_store.master``: the master as a service (see ``service.main``)."""

import sys

from .service import main

sys.exit(main())
