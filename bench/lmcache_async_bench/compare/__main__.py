"""``python -m lmcache_async_bench.compare``: the A/B comparison with LMCache 0.5.6."""

import sys

from .driver import main

sys.exit(main())
