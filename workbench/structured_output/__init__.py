"""Structured outputs: grammars compiled off the engine thread, one token bitmask per step."""
