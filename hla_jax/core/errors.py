"""Errors as one line: the innermost cause of a chain and its first line."""


def root_cause(error: BaseException) -> BaseException:
    """The innermost exception of ``error``'s chain (``__cause__``, else ``__context__`` unless
    it was raised ``from None``): e.g. tensorstore's error under orbax's."""
    while True:
        inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if inner is None:
            return error
        error = inner


def message(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def first_line(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``root_cause(error)``, its first line, at most ``limit`` characters
    of message."""
    error = root_cause(error)
    return f"{type(error).__name__}: {message(error)[:limit]}"
