"""Helpers shared by the tests: server processes, fakes, tiny models, kernel cases."""
