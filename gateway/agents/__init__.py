"""Agents: the offline `echo` default and any OpenAI-compatible Chat Completions endpoint."""

from gateway.agents.base import Agent, AgentError

__all__ = ["Agent", "AgentError"]
