"""Requests the chat-feature tests and the parity tests share: a question,
a JSON schema, two tools a random model can only call validly when constrained."""

from __future__ import annotations

from tests.integration.cases import data_url

QUESTION = [{"role": "user", "content": "Describe the image."}]
COLOURS = ["red", "green", "blue", "yellow"]
SCENE_SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": COLOURS}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Today's weather in a city.", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time", "strict": True,
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False},
    },
}


def image_part(images, name: str = "square") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(images[name])}}


def loose(tool: dict) -> dict:
    """The tool without `strict`, for `tool_choice: auto`: the demo's engine
    (engine.strict_tool_calling off) refuses a strict tool there, since it cannot
    hold such a call's arguments to the schema."""
    return {**tool, "function": {k: v for k, v in tool["function"].items() if k != "strict"}}
