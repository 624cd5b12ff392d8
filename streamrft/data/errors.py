"""The one error type of dataset reading (its own module, so the raw-row reader and the datasets share it)."""


class DataError(ValueError):
    """A dataset file or row that cannot be used; the message names file, row and field."""
