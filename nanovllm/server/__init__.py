"""The OpenAI-compatible HTTP server: one engine loop (in its own process, or a thread) behind an asyncio (Starlette + uvicorn) front end."""
