"""Text tags that a stream may deliver in pieces (``<think>``, ``<tool_call>``, ...)."""


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``: what a stream must hold
    back, since the next characters may complete the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
