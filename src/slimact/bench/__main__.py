"""``python -m slimact.bench quick|full|gpu [flags]`` (same as ``slimact bench``)."""

from slimact.bench.cli import main
from slimact.bench.deadline import exit_process

exit_process(main())
