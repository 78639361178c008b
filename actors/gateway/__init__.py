"""The gateway role: the OpenAI API over HTTP in front of the run's generators, with exact
token-in/token-out per episode (docs/agents.md).

- `actor.py`: `GatewayActor` (config: `postrain.actors.gateway:GatewayActor`) and its options;
- `app.py`: the Starlette app (routes, API errors, server-sent events);
- `http_server.py`: the lean HTTP/1.1 server the app runs on (trio sockets; hypercorn optional), its
  caps (`ServerLimits`: connections, head and body bytes, timeouts);
- `http_parser.py`: strict RFC 9112 request parsing, sans I/O (no request smuggling);
- `auth.py`: the API key (required off loopback) and the episodes' keys, checked before `/v1/` calls;
- `service.py`: one call, apart from HTTP: render or extend, generate, parse tool calls;
- `protocol.py`: the API's requests checked into typed calls, `APIError`;
- `episodes.py`: token-in/token-out: each episode's segments;
- `templates.py`: conversations with tools through the model's chat template (or the default);
- `tool_calls.py`: Hermes/Qwen and Llama 3 tool calls parsed from the model's text;
- `pool.py`: load spreading over the generators, the bound on requests in flight;
- `records.py`: the actor's typed messages.
"""
from .actor import GatewayActor, GatewayOptions
from .episodes import EpisodeStore, EpisodeTokens, Segment
from .protocol import APIError
from ..records import CloseEpisode, EpisodeSegments, GatewayAddress, OpenEpisode
from .tool_calls import parse_tool_calls, tool_call_format

__all__ = ["APIError", "CloseEpisode", "EpisodeSegments", "EpisodeStore", "EpisodeTokens", "GatewayActor",
           "GatewayAddress", "GatewayOptions", "OpenEpisode", "Segment", "parse_tool_calls", "tool_call_format"]
