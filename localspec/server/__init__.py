"""OpenAI-compatible HTTP front end over the speculative engine.

``create_app`` lives in ``localspec.server.app`` (it imports Starlette); this package itself
imports nothing heavy so the CLI stays fast.
"""

from .config import ServerConfig

__all__ = ["ServerConfig"]
