"""``python -m zeroshard ...``: the same as the ``zeroshard`` console script."""

import sys

from .cli import main

sys.exit(main())
