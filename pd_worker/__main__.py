"""``python -m pd_worker``: same as the ``pd-worker`` command."""

import sys

from pd_worker.cli import main

sys.exit(main())
