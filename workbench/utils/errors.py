"""describe(exc): the one text form of a per-request failure."""


def describe(exc: BaseException) -> str:
    """``"ExcType: message"``: how a per-request failure is reported (``RequestOutput.error``,
    a sweep row's ``error``)."""
    return f"{type(exc).__name__}: {exc}"
