import sys

from inflight.cli import main

sys.exit(main())
