"""Routing: the encoder and engine pools, their replicas and sockets, DNS
discovery, and the visual-token hand-off between them (handoff.py). Imports
intake (the images it hands on), operations and the gateway's base; never the
API."""
