"""The way in: gates in a declared order, de-duplication, ownership, then admission."""
