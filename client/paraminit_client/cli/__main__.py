"""`python -m paraminit_client.cli`: the `paraminit` command."""

import sys

from paraminit_client.cli import main

sys.exit(main())
