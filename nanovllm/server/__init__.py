"""The OpenAI-compatible HTTP server: one engine loop (in its own process, or a thread) behind an asyncio (Starlette + uvicorn) front end."""

# uvicorn's choices for the front end (`nanovllm serve --uvicorn-loop / --uvicorn-http`): auto takes uvloop and
# httptools where installed. Here, with no imports, so that the command line's parsers need not import the server.
UVICORN_LOOPS = ("auto", "uvloop", "asyncio")
HTTP_PARSERS = ("auto", "httptools", "h11")
