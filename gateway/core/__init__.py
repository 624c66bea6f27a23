"""The session core: messages, commands, cancellation, the router and turns. Imports nothing above it."""
