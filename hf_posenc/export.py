"""`hf_posenc.export` is hf_posenc/checkpoints/export.py under its former name (the same module object), so that
`python -m hf_posenc.export CHECKPOINT [OUTPUT]` and the `hf-posenc-export` command keep working."""

import sys

from .checkpoints import export

if __name__ == "__main__":
    raise SystemExit(export.main())
sys.modules[__name__] = export
