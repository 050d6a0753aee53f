"""``python -m lmcache_async.cli``: the ``lmcache-async`` command (the node server's launchers use it)."""

import sys

from lmcache_async.cli import main

sys.exit(main())
