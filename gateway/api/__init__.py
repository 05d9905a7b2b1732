"""The HTTP API and its streams: the FastAPI app, the OpenAI chat route, the
request body and response shapes, admission, and each model's pipeline
(intake, then the hand-off to encoder and engine). The top room: it may import
every other room of the gateway, and none imports it."""
