"""``python -m hf_posenc COMMAND ...`` (and ``accelerate launch -m hf_posenc COMMAND ...``): the ``hf-posenc``
command."""

import sys

from .tools.cli import main

sys.exit(main())
