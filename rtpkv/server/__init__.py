"""rtpkv's HTTP server (`rtpkv serve`, extra `server`): rtp-llm's native route and OpenAI's."""

from rtpkv.server.app import create_app
from rtpkv.server.main import serve

__all__ = ["create_app", "serve"]
