"""``python -m slimact.bench quick|full|gpu [flags]`` (same as ``slimact bench``)."""

import sys

from slimact.bench.cli import main

sys.exit(main())
