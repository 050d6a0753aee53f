"""``python -m lmcache_async.bench.compare``: the A/B comparison with LMCache 0.5.6."""

import sys

from lmcache_async.bench.compare.driver import main

sys.exit(main())
