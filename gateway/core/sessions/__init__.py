"""Per-session runtime: lanes (one turn at a time), the admission decision, commands, automatic messages."""
