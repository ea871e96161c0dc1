"""The checkpoint code now lives in hf_posenc/checkpoints/ (metadata, saving, restore, loading); the names below stay
importable from their former module."""

from .checkpoints.loading import from_pretrained
from .checkpoints.metadata import POSENC_CONFIG_NAME, read_metadata, write_metadata
from .checkpoints.restore import apply_saved_patch, load_saved_patch
from .checkpoints.saving import attach_save_hook, posenc_metadata

__all__ = ["POSENC_CONFIG_NAME", "apply_saved_patch", "attach_save_hook", "from_pretrained", "load_saved_patch",
           "posenc_metadata", "read_metadata", "write_metadata"]
