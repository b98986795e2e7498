"""``python -m burstattn.cli ...`` (e.g. under torchrun: ``torchrun ... -m burstattn.cli train ...``)."""
import sys

from . import main

sys.exit(main())
