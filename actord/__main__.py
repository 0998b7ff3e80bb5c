"""`python -m actord`: the `actord` program (actord/cli.py), for an environment
without its console script on PATH."""

import sys

from actord.cli import main

sys.exit(main())
