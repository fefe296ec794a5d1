import sys

from kvxfer.cli import main

sys.exit(main())
