import sys

from slimact.cli import main

sys.exit(main())
