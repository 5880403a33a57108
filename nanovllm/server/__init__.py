"""The OpenAI-compatible HTTP server: one engine thread behind an asyncio (Starlette + uvicorn) front end."""
