"""Where the services listen unless told otherwise: one host, local sockets.

The encoder and engine bind these, and the gateway connects to them, so a
stack started with no addresses configured finds itself.
"""

ENCODER_ADDRESS = "ipc:///tmp/prism/encoder.sock"
ENGINE_ADDRESS = "ipc:///tmp/prism/engine.sock"
