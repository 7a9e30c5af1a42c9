"""The engine's core: requests, KV block accounting and scheduling. Standard library only."""
