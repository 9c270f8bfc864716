"""The one error every bad checkpoint input raises."""

from monolith.formats import FormatError


class CheckpointError(FormatError):
    """A checkpoint cannot be found or read; the message names the file and the
    tensor or field at fault."""
