"""The one exception type hf_posenc raises for bad input."""


class PosEncError(ValueError):
    """Bad input to hf_posenc: an unknown method or option, an invalid value, or an unsupported model.

    A subclass of ValueError so callers that catch ValueError keep working.
    """
