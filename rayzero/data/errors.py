class DataError(ValueError):
    """A dataset that is missing, malformed, or too small for the job; or a source or tokenizer
    that cannot make one. The message names the file (and line) at fault."""
