"""`python -m turbine_fmha.cli`."""

import sys

from turbine_fmha.cli.main import main

sys.exit(main())
