"""Where the services listen unless told otherwise: one host, local sockets.

The encoder and engine bind these, and the gateway connects to them, so a
stack started with no addresses configured finds itself.
"""

import re
from typing import Annotated

from pydantic import AfterValidator

ENCODER_ADDRESS = "ipc:///tmp/prism/encoder.sock"
ENGINE_ADDRESS = "ipc:///tmp/prism/engine.sock"

_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\s\[\]]+):(?P<port>\d{1,5}|\*)|ipc://\S+|inproc://\S+")


def check_address(address: str) -> str:
    """A ZMQ endpoint as the services bind and connect them; anything else is refused at
    start-up naming its key, not by ZMQ's "Invalid argument" once the service runs."""
    form = _ADDRESS.fullmatch(address)
    if form is None or (form["port"] not in (None, "*") and int(form["port"]) > 65535):
        raise ValueError(f"{address!r} is not a ZMQ address: tcp://host:port, ipc:///path or inproc://name")
    return address


ZmqAddress = Annotated[str, AfterValidator(check_address)]
