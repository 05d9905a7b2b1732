"""The HTTP gateway: OpenAI-compatible API, image intake, orchestration."""
