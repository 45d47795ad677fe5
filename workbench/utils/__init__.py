"""Small helpers every room may use (no torch, no engine)."""
