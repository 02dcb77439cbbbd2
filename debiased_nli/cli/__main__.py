"""`python -m debiased_nli.cli` (as `accelerate launch -m debiased_nli.cli` runs it)."""
import sys

from . import main

sys.exit(main())
