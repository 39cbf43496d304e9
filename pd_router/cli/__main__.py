import sys

from pd_router.cli.main import main

sys.exit(main())
