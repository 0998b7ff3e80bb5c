"""`python -m actord`: the `actord` program (actord/frontends/cli.py), for an environment
without its console script on PATH."""

import sys

from actord.frontends.cli import main

sys.exit(main())
