"""Helpers for the tests (not tests themselves): processes, servers, workers, ports, routers."""
