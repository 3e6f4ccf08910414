"""One exception type for everything a user can get wrong.

The CLI, the app and the notebooks catch :class:`SpeclabError` and show its message as one line;
anything else is a bug and keeps its traceback.
"""


class SpeclabError(Exception):
    """A user-facing error: bad model path, tokenizer mismatch, k out of range, bad prompt, ..."""
