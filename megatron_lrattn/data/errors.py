"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """Bad data-pipeline input: a missing file, an unknown JSON key, a missing tokenizer.

    The message is one line naming the file or the problem; CLIs print it and exit with
    status 2 instead of showing a traceback.
    """
