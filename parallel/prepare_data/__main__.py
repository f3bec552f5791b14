"""`python -m parallel.prepare_data`: see parallel/prepare_data/prepare.py."""
import sys

from parallel.prepare_data.prepare import main

sys.exit(main())
